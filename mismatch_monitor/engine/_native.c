/* The metric engine's two per-token loops, compiled: the token pass and the routing flips.
 *
 * Loaded with ctypes (engine/native.py); the module init below only lets the build system and
 * importlib find the shared object. Every number these loops use (bin edges, region bounds,
 * bucket edges, sorting network) is computed in Python from MetricConfig and passed in, so the
 * definitions stay in one place; this file holds loops, not definitions.
 *
 * Both loops read every input once, keep no temporaries, and accumulate into arrays the caller
 * owns (zeroed by the caller), so calls on consecutive ranges of tokens add up.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ token pass */

/* Mirrored by native.TokenParams (ctypes); keep the order. */
typedef struct {
    int64_t n_turn;                 /* turn buckets per sequence cell (1 without turns) */
    int64_t turn_last;              /* last index of the turn table */
    int64_t NL, R, NB;              /* lowprob buckets, regions, histogram bins */
    double tol;                     /* a log-prob above this is invalid */
    double outlier_abs;             /* |lr| below this lies in slot 0 (lr <= 0) or 1 (lr > 0) */
    double poly_max;                /* |lr| below this: k3 and exp|lr| from their Taylor series */
    const double *log_edges;        /* [NL - 1] log of the lowprob edges */
    const double *region_bounds;    /* [R - 1] region boundaries of lr */
    const int64_t *slot_of_region;  /* [R] */
    const double *upper;            /* [NB] upper edge of each |lr| bin (last: +inf) */
    const int64_t *lut;             /* first bin of each (exponent, top mantissa bits) key */
    int64_t lut_shift, lut_base, lut_size;
    const double *series;           /* [N_SERIES] 1/2!, 1/3!, ...: rho - 1 - lr = lr^2 sum c_i lr^i */
    int64_t n_series;
    int64_t n_seq;                  /* sequences: seq ids lie in [0, n_seq) */
} TokenParams;

#define N_SERIES 9
#define LW 4                  /* joint bins, local and the caller's: count, lr, k3, rho^2 */
#define BLOCK 256             /* tokens per block: the block's arrays stay in L1 */

/* A block of tokens: the vector stage fills it, the scalar stage adds it up. */
typedef struct {
    double t[BLOCK], s[BLOCK];
    double lr[BLOCK], k3[BLOCK], e_abs[BLOCK], rho2[BLOCK];
    int64_t cell[BLOCK];      /* token cell */
    int64_t joint[BLOCK];     /* lowprob bucket * R + (lr > 0): the slot of a central lr */
    int64_t slot[BLOCK];      /* lr > 0 */
    int64_t bin[BLOCK];       /* |lr| histogram bin */
    int64_t rare[BLOCK];      /* invalid, or |lr| beyond the series or the central regions */
} Block;

static void load_block(const void *src, int dtype, int64_t start, int64_t m, double *dst) {
    if (dtype) {
        memcpy(dst, (const double *)src + start, (size_t)m * sizeof(double));
    } else {
        const float *f = (const float *)src + start;
        for (int64_t i = 0; i < m; i++) dst[i] = f[i];
    }
}

/* |lr| histogram bin of each lr: the lookup's first bin for the key (exponent and top mantissa
 * bits), one step up if above that bin's upper edge. Branch-free, so that it vectorizes. */
static inline __attribute__((always_inline)) void bins_of(const TokenParams *p, int64_t m,
                                                          const double *restrict lr, int64_t *restrict out) {
    const int64_t shift = p->lut_shift, base = p->lut_base, last = p->lut_size - 1, over = p->NB - 1;
    const double zero_edge = p->upper[0], over_edge = p->upper[p->NB - 2];
    const int64_t *restrict lut = p->lut;
    const double *restrict upper = p->upper;
    for (int64_t i = 0; i < m; i++) {
        const double a = fabs(lr[i]);
        union { double d; int64_t i; } bits = {a};
        int64_t key = (bits.i >> shift) - base;
        key = key < 0 ? 0 : key;
        key = key > last ? last : key;
        int64_t bin = lut[key];
        const double up = upper[bin];
        bin = bin + (a > up ? 1 : 0);
        bin = a > zero_edge ? bin : 0;
        out[i] = a > over_edge ? over : bin;
    }
}

/* Straight-line loops over a block, written for the compiler to vectorize. With
 * P(x) = sum_i c_i x^i = E(x^2) + O(x) (even and odd parts; O has the sign of x):
 * rho - 1 - lr = lr^2 P(lr) and exp|lr| = 1 + |lr| + lr^2 P(|lr|) = 1 + |lr| + lr^2 (E + |O|).
 * Rare tokens (invalid, |lr| >= poly_max, or outside the two central regions) are finished by
 * the scalar stage. */
static inline int block_values(const TokenParams *p, int64_t m, Block *b, const int64_t *restrict seq,
                               const int64_t *restrict turn, const int64_t *restrict seq_cell,
                               const int64_t *restrict turn_table) {
    const double *c = p->series;
    const double tol = p->tol, lowest = -DBL_MAX;
    const double rare_abs = p->poly_max < p->outlier_abs ? p->poly_max : p->outlier_abs;
    const int64_t R = p->R;
    for (int64_t i = 0; i < m; i++) {
        const double t = b->t[i], s = b->s[i];
        const double lr = t - s, x2 = lr * lr, x4 = x2 * x2;
        const double even = (c[0] + c[2] * x2) + x4 * ((c[4] + c[6] * x2) + x4 * c[8]);
        const double odd = lr * ((c[1] + c[3] * x2) + x4 * (c[5] + c[7] * x2));
        const double k3 = x2 * (even + odd);
        const double rho = 1.0 + lr + k3;
        b->lr[i] = lr;
        b->k3[i] = k3;
        b->e_abs[i] = 1.0 + fabs(lr) + x2 * (even + fabs(odd));
        b->rho2[i] = rho * rho;
        const int64_t ok = (t <= tol) & (s <= tol) & (t >= lowest) & (s >= lowest);
        b->rare[i] = !ok | (fabs(lr) >= rare_abs);
        b->joint[i] = b->slot[i] = lr > 0;
    }
    for (int64_t e = 0; e < p->NL - 1; e++) {      /* lowprob bucket = edges <= log p */
        const double edge = p->log_edges[e];
        for (int64_t i = 0; i < m; i++) b->joint[i] += (b->s[i] >= edge) * R;
    }
    /* ids out of range (a batch built without validation) stop the pass before any lookup */
    uint64_t bad = 0;
    for (int64_t i = 0; i < m; i++) bad |= (uint64_t)seq[i] >= (uint64_t)p->n_seq;
    if (turn)
        for (int64_t i = 0; i < m; i++) bad |= (uint64_t)(turn[i] < 0);
    if (bad) return 0;
    if (turn) {
        const int64_t n_turn = p->n_turn, last = p->turn_last;
        for (int64_t i = 0; i < m; i++) {
            const int64_t tu = turn[i];
            b->cell[i] = seq_cell[seq[i]] * n_turn + turn_table[tu > last ? last : tu];
        }
    } else {
        for (int64_t i = 0; i < m; i++) b->cell[i] = seq_cell[seq[i]];
    }
    bins_of(p, m, b->lr, b->bin);
    return 1;
}

typedef struct {
    double *joint, *cell_sums, *min_lr, *max_lr, *seq_sum_lr, *seq_sum_exp_abs, *seq_max_abs;
    int32_t *abs_hist;        /* 32-bit: its hot part stays in L2 (see mm_token_pass) */
    int64_t *n_nonfinite, *n_positive, *seq_invalid;
} Out;

/* The current cell's joint bins and |lr| histogram are kept small (in L1) in `local` and
 * `lhist` and added to the caller's arrays when the cell changes (adding each token straight
 * into the [cells x bins] histogram of megabytes misses the cache on most tokens); `touched`
 * lists the histogram bins with counts, in first-touch order. The joint bins hold what
 * token_pass.py reads per (lowprob, slot) bin: count, lr and k3; and rho^2 per slot, kept on
 * the bin of lowprob bucket 0. Sums of lr^2 and exp|lr| are read only per cell: `cell_sums`. */
static void end_cell(const Out *out, int64_t nj, int64_t NB, int64_t cell, double *local, int64_t *lhist,
                     const int64_t *touched, int64_t n_touched, double min_lr, double max_lr, double lr2,
                     double exp_abs) {
    int32_t *h = out->abs_hist + cell * NB;
    for (int64_t k = 0; k < n_touched; k++) {
        const int64_t b = touched[k];
        h[b] += (int32_t)lhist[b];
        lhist[b] = 0;
    }
    if (min_lr < out->min_lr[cell]) out->min_lr[cell] = min_lr;
    if (max_lr > out->max_lr[cell]) out->max_lr[cell] = max_lr;
    double *dst = out->joint + cell * nj * LW;
    for (int64_t j = 0; j < nj; j++) {
        double *src = local + j * LW;
        if (src[0] == 0.0 && src[3] == 0.0) continue;
        for (int w = 0; w < LW; w++) {
            dst[j * LW + w] += src[w];
            src[w] = 0.0;
        }
    }
    out->cell_sums[2 * cell] += lr2;
    out->cell_sums[2 * cell + 1] += exp_abs;
}

static void end_sequence(const Out *out, int64_t seq, int64_t invalid, double sum_lr, double sum_exp_abs,
                         double max_abs) {
    out->seq_invalid[seq] += invalid;
    out->seq_sum_lr[seq] += sum_lr;
    out->seq_sum_exp_abs[seq] += sum_exp_abs;
    if (max_abs > out->seq_max_abs[seq]) out->seq_max_abs[seq] = max_abs;
}

/* Both stages over every block; built for AVX2 + FMA too, picked at load time where the CPU
 * has them. The running values of the current sequence and cell are plain locals (registers):
 * held in a struct whose address escapes, each += would go through memory. */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static int64_t token_blocks(const TokenParams *p, int64_t n, const void *t, int t_dtype, const void *s,
                            int s_dtype, const int64_t *restrict seq, const int64_t *restrict turn,
                            const int64_t *restrict seq_cell, const int64_t *restrict turn_table,
                            const Out *out, double *restrict local, int64_t *restrict lhist,
                            int64_t *restrict touched, Block *restrict blk) {
    const int64_t nj = p->NL * p->R, NB = p->NB, R = p->R;
    const double poly_max = p->poly_max, outlier_abs = p->outlier_abs;
    int64_t valid = 0;
    int64_t cur_seq = -1, seq_invalid = 0, cur_cell = -1;
    double seq_lr = 0.0, seq_exp = 0.0, seq_max = 0.0;
    double cell_min = INFINITY, cell_max = -INFINITY, cell_lr2 = 0.0, cell_exp = 0.0;
    int64_t n_touched = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t m = n - start < BLOCK ? n - start : BLOCK;
        load_block(t, t_dtype, start, m, blk->t);
        load_block(s, s_dtype, start, m, blk->s);
        if (!block_values(p, m, blk, seq + start, turn ? turn + start : NULL, seq_cell, turn_table)) return -3;
        for (int64_t k = 0; k < m; k++) {
            const int64_t sq = seq[start + k], cell = blk->cell[k];
            if (sq != cur_seq) {
                if (cur_seq >= 0) end_sequence(out, cur_seq, seq_invalid, seq_lr, seq_exp, seq_max);
                cur_seq = sq;
                seq_invalid = 0;
                seq_lr = seq_exp = seq_max = 0.0;
            }
            if (cell != cur_cell) {
                if (cur_cell >= 0)
                    end_cell(out, nj, NB, cur_cell, local, lhist, touched, n_touched, cell_min, cell_max,
                             cell_lr2, cell_exp);
                n_touched = 0;
                cur_cell = cell;
                cell_min = INFINITY;
                cell_max = -INFINITY;
                cell_lr2 = cell_exp = 0.0;
            }
            const double lr = blk->lr[k], a = fabs(lr);
            double k3 = blk->k3[k], e_abs = blk->e_abs[k], rho2 = blk->rho2[k];
            int64_t jb = blk->joint[k], slot = blk->slot[k];
            if (blk->rare[k]) {
                const double tv = blk->t[k], sv = blk->s[k];
                if (!(isfinite(tv) && isfinite(sv))) {
                    out->n_nonfinite[cell]++;
                    seq_invalid++;
                    continue;
                }
                if (tv > p->tol || sv > p->tol) {
                    out->n_positive[cell]++;
                    seq_invalid++;
                    continue;
                }
                if (a >= poly_max) {                     /* beyond the series: exactly */
                    const double em1 = expm1(lr);
                    k3 = em1 - lr;
                    e_abs = exp(a);
                    rho2 = (em1 + 1.0) * (em1 + 1.0);
                }
                if (a >= outlier_abs) {                  /* first boundary >= lr: its slot */
                    int64_t region = 0;
                    while (region < R - 1 && p->region_bounds[region] < lr) region++;
                    slot = p->slot_of_region[region];
                    jb += slot - (lr > 0);
                }
            }
            valid++;
            double *j = local + jb * LW;
            j[0] += 1.0;
            j[1] += lr;
            j[2] += k3;
            local[slot * LW + 3] += rho2;
            const int64_t bin = blk->bin[k];
            touched[n_touched] = bin;                    /* kept when it is the bin's first */
            n_touched += lhist[bin]++ == 0;
            cell_lr2 += lr * lr;
            cell_exp += e_abs;
            cell_min = lr < cell_min ? lr : cell_min;
            cell_max = lr > cell_max ? lr : cell_max;
            seq_lr += lr;
            seq_exp += e_abs;
            seq_max = a > seq_max ? a : seq_max;
        }
    }
    if (cur_seq >= 0) end_sequence(out, cur_seq, seq_invalid, seq_lr, seq_exp, seq_max);
    if (cur_cell >= 0)
        end_cell(out, nj, NB, cur_cell, local, lhist, touched, n_touched, cell_min, cell_max, cell_lr2, cell_exp);
    return valid;
}

/* Every token statistic of n tokens, added into the caller's arrays (see TokenAccumulators in
 * token_pass.py; `joint` is [cells * NL * R, LW], `cell_sums` [cells, 2] (sums of lr^2 and of
 * exp|lr|); `abs_hist` is [cells * NB] int32, for
 * batches of fewer than 2^31 tokens). Invalid tokens (non-finite, or a log-prob
 * above tol) count per cell and per sequence and touch nothing else. Returns the number of
 * valid tokens; -1 when the series has not the N_SERIES coefficients this file was compiled
 * for, -2 when memory runs out, -3 when a sequence id or turn index is out of range (nothing
 * is read through it; the caller's arrays then hold part of the pass). */
int64_t mm_token_pass(const TokenParams *p, int64_t n, const void *t, int t_dtype, const void *s,
                      int s_dtype, const int64_t *seq, const int64_t *turn, const int64_t *seq_cell,
                      const int64_t *turn_table, double *joint, double *cell_sums, int32_t *abs_hist,
                      double *min_lr,
                      double *max_lr, int64_t *n_nonfinite, int64_t *n_positive, int64_t *seq_invalid,
                      double *seq_sum_lr, double *seq_sum_exp_abs, double *seq_max_abs) {
    if (p->n_series != N_SERIES) return -1;
    double *local = calloc((size_t)(p->NL * p->R * LW), sizeof(double));
    int64_t *lhist = calloc((size_t)p->NB, sizeof(int64_t));
    int64_t *touched = malloc((size_t)(p->NB + 1) * sizeof(int64_t));
    Block *blk = malloc(sizeof(Block));
    int64_t valid = -2;
    if (local && lhist && touched && blk) {
        Out out = {joint, cell_sums, min_lr, max_lr, seq_sum_lr, seq_sum_exp_abs, seq_max_abs,
                   abs_hist, n_nonfinite, n_positive, seq_invalid};
        valid = token_blocks(p, n, t, t_dtype, s, s_dtype, seq, turn, seq_cell, turn_table, &out, local, lhist,
                             touched, blk);
    }
    free(local);
    free(lhist);
    free(touched);
    free(blk);
    return valid;
}

/* ------------------------------------------------------------------ non-zero entries */

/* Indices of the non-zero entries of values[0..n) (`size` bytes each: 4 or 8), ascending,
 * into out; returns how many. */
int64_t mm_nonzero(const void *values, int64_t n, int64_t size, int64_t *out) {
    int64_t k = 0;
    if (size == 4) {
        const int32_t *v = values;
        for (int64_t i = 0; i < n; i++) {
            out[k] = i;
            k += v[i] != 0;
        }
    } else {
        const int64_t *v = values;
        for (int64_t i = 0; i < n; i++) {
            out[k] = i;
            k += v[i] != 0;
        }
    }
    return k;
}

/* ------------------------------------------------------------------ routing flips */

static inline uint64_t load_id(const unsigned char *row, int64_t size, int64_t k) {
    switch (size) {
    case 1: return row[k];
    case 2: { uint16_t v; memcpy(&v, row + 2 * k, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, row + 4 * k, 4); return v; }
    default: { uint64_t v; memcpy(&v, row + 8 * k, 8); return v; }
    }
}

/* A sorting network for K inputs (routing.sorting_network), mirrored by native.Network:
 * comparator pairs, and for top-8 byte ids the same comparators in layers of disjoint pairs as
 * 16-lane vectors (both rows at once: lanes 0-7 and 8-15): each lane's partner (itself when it
 * has none) and 0xff where the lane keeps the minimum. */
typedef struct {
    const int32_t *pairs;
    int64_t n_pairs;
    const unsigned char *partner, *lower;   /* [n_layers * 16] each */
    int64_t n_layers;                       /* 0: no byte layers */
} Network;

static inline void sort_ids(uint64_t *v, const Network *net) {
    for (int64_t c = 0; c < net->n_pairs; c++) {
        const int32_t i = net->pairs[2 * c], j = net->pairs[2 * c + 1];
        const uint64_t a = v[i], b = v[j];
        v[i] = a < b ? a : b;
        v[j] = a < b ? b : a;
    }
}

typedef unsigned char V16 __attribute__((vector_size(16)));

/* Top-8 byte ids of both sides in one 16-byte vector, sorted layer by layer: every lane meets
 * its partner, the lower lane keeps the minimum and the upper one the maximum. */
#define MAX_BYTE_LAYERS 16

/* The byte layers as vectors, loaded once per call. */
typedef struct {
    V16 partner[MAX_BYTE_LAYERS], lower[MAX_BYTE_LAYERS];
    int64_t n;
} ByteLayers;

static inline int differ_top8_bytes(const unsigned char *tr, const unsigned char *sr, const ByteLayers *bl) {
    V16 v;
    memcpy(&v, tr, 8);
    memcpy((unsigned char *)&v + 8, sr, 8);
    for (int64_t l = 0; l < bl->n; l++) {
        const V16 w = __builtin_shuffle(v, bl->partner[l]);
        const V16 lt = (V16)(v < w);
        const V16 lo = (v & lt) | (w & ~lt), hi = (w & lt) | (v & ~lt);
        v = (lo & bl->lower[l]) | (hi & ~bl->lower[l]);
    }
    uint64_t x, y;
    memcpy(&x, &v, 8);
    memcpy(&y, (unsigned char *)&v + 8, 8);
    return x != y;
}

/* Whether two rows of K ids hold different multisets: sorted and compared. */
static inline int differ_as_sets(const unsigned char *tr, const unsigned char *sr, int64_t K, int64_t size,
                                 const Network *net, const ByteLayers *bl, uint64_t *a, uint64_t *b) {
    if (size == 1 && K == 8 && bl->n > 0) return differ_top8_bytes(tr, sr, bl);
    for (int64_t k = 0; k < K; k++) {
        a[k] = load_id(tr, size, k);
        b[k] = load_id(sr, size, k);
    }
    sort_ids(a, net);
    sort_ids(b, net);
    return memcmp(a, b, (size_t)K * sizeof a[0]) != 0;
}

/* [n, L, K] ids of `size` bytes from both sides; a (token, layer) flips when the sorted ids
 * differ (the multiset of the top-k; order inside the top-k does not count). Adds flips per
 * (cell, layer) and tokens with any flip per cell. `net` sorts K inputs. Returns the number
 * of flips, or -1 when K is above the supported 64 (or the byte layers above 16). */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static int64_t routing_loop(int64_t n, int64_t L, int64_t K, int64_t size, const void *trainer,
                            const void *sampler, const int64_t *cell, const Network *net, int64_t *per_layer,
                            int64_t *any_flip) {
    if (K > 64 || net->n_layers > MAX_BYTE_LAYERS) return -1;
    ByteLayers bl;
    bl.n = net->n_layers;
    for (int64_t l = 0; l < bl.n; l++) {
        memcpy(&bl.partner[l], net->partner + 16 * l, 16);
        memcpy(&bl.lower[l], net->lower + 16 * l, 16);
    }
    const int64_t row = K * size;
    const unsigned char *te = (const unsigned char *)trainer, *se = (const unsigned char *)sampler;
    uint64_t a[64], b[64];
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t c = cell[i];
        int64_t flips = 0;
        for (int64_t l0 = 0; l0 < L; l0 += 64) {
            const int64_t nl = L - l0 < 64 ? L - l0 : 64;
            /* which rows differ in order, without a branch per row; then only those */
            uint64_t differ = 0;
            if (row == 8) {
                const unsigned char *x = te + (i * L + l0) * row, *y = se + (i * L + l0) * row;
                for (int64_t l = 0; l < nl; l++) {
                    uint64_t xv, yv;
                    memcpy(&xv, x + 8 * l, 8);
                    memcpy(&yv, y + 8 * l, 8);
                    differ |= (uint64_t)(xv != yv) << l;
                }
            } else {
                for (int64_t l = 0; l < nl; l++) {
                    const int64_t at = (i * L + l0 + l) * row;
                    differ |= (uint64_t)(memcmp(te + at, se + at, (size_t)row) != 0) << l;
                }
            }
            while (differ) {
                const int64_t l = l0 + __builtin_ctzll(differ);
                differ &= differ - 1;
                const unsigned char *tr = te + (i * L + l) * row, *sr = se + (i * L + l) * row;
                if (differ_as_sets(tr, sr, K, size, net, &bl, a, b)) {
                    per_layer[c * L + l]++;
                    flips = 1;
                    total++;
                }
            }
        }
        any_flip[c] += flips;
    }
    return total;
}

int64_t mm_routing_flips(int64_t n, int64_t L, int64_t K, int64_t size, const void *trainer,
                         const void *sampler, const int64_t *cell, const Network *net, int64_t *per_layer,
                         int64_t *any_flip) {
    return routing_loop(n, L, K, size, trainer, sampler, cell, net, per_layer, any_flip);
}

/* ------------------------------------------------------------------ module */

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Compiled loops of the metric engine; called through ctypes (see engine/native.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
