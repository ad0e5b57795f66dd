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

/* The layout of the structs native.py passes in; a library built from another version of this
 * file answers another number, and native.py refuses to call it (no call with a stale layout). */
#define MM_ABI_VERSION 4

int64_t mm_abi_version(void) { return MM_ABI_VERSION; }

/* Per-ISA builds of the hot loops (picked at load time) where the compiler and the CPU family
 * allow it: GCC and clang on x86-64. Elsewhere (arm64, other compilers) one portable build;
 * -DMM_PORTABLE builds that one on x86-64 too (the tests compare it with the others). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MM_PORTABLE)
#define CLONES_TOKEN __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define CLONES_ROUTING __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLONES_TOKEN
#define CLONES_ROUTING
#endif

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
    int64_t n_cells;                /* token cells + the dump cell: the row length of Out.p_sums */
} TokenParams;

#define N_SERIES 9
#define LW 4                  /* local joint bins: count, lr, k3, rho^2 */
#define BLOCK 256             /* tokens per block: the block's arrays stay in L1 */
#define COPIES 2              /* local joint bins: even and odd tokens add into their own copy */

typedef double V4 __attribute__((vector_size(32)));

/* Token ranges in the order the pass takes them: [start, stop) of one sequence `seq`, or of
 * any tokens when seq < 0 (their ids are then read from the seq array). Ranges of one sequence
 * cell one after the other let the cell's bins stay local until the next cell (see Local). */
typedef struct {
    int64_t start, stop, seq;
} Range;

/* A block of tokens: the vector stage fills it, the scalar stage adds it up. A "rare" token
 * (invalid, or |lr| beyond the series or the central regions) has zeros in v, lr and e_abs,
 * NaN in lr_mm (the only tokens with NaN there) and the dump bin NB in bin; the scalar stage
 * adds it on its own. */
typedef struct {
    double t[BLOCK], s[BLOCK];
    V4 v[BLOCK];              /* 1, lr, k3, rho^2 */
    double lr[BLOCK], lr_mm[BLOCK], e_abs[BLOCK];
    double ps[BLOCK], dp[BLOCK];  /* p_S = exp(s) and p_T - p_S = p_S (rho - 1) */
    int64_t seq[BLOCK];       /* sequence */
    int64_t sc[BLOCK];        /* sequence cell */
    int64_t tb[BLOCK];        /* turn index */
    uint8_t brk[BLOCK + 8];   /* 1 where a run starts (block_values) */
    int64_t jb[BLOCK];        /* central joint bin: lowprob bucket * 2 + (lr > 0) */
    int64_t bin[BLOCK];       /* |lr| histogram bin */
} Block;

/* Log-probs as doubles; `dtype` 0: float32, 1: float64, 2: bfloat16 (the top half of a
 * float32, so exactly a float32 with a zero low half). */
static inline __attribute__((always_inline)) void load_values(const void *src, int dtype, int64_t start, int64_t m,
                                                              double *dst) {
    if (dtype == 1) {
        memcpy(dst, (const double *)src + start, (size_t)m * sizeof(double));
    } else if (dtype == 2) {
        const uint16_t *h = (const uint16_t *)src + start;
        for (int64_t i = 0; i < m; i++) {
            const uint32_t bits = (uint32_t)h[i] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            dst[i] = f;
        }
    } else {
        const float *f = (const float *)src + start;
        for (int64_t i = 0; i < m; i++) dst[i] = f[i];
    }
}

/* |lr| histogram bin of each lr: the lookup's first bin for the key (exponent and top mantissa
 * bits), one step up if above that bin's upper edge. Branch-free, so that it vectorizes. */
static inline __attribute__((always_inline)) void bins_of(const TokenParams *p, const double *restrict lut_up,
                                                          int64_t m, const double *restrict lr,
                                                          int64_t *restrict out) {
    const int64_t shift = p->lut_shift, base = p->lut_base, last = p->lut_size - 1, over = p->NB - 1;
    const double zero_edge = p->upper[0], over_edge = p->upper[p->NB - 2];
    const int64_t *restrict lut = p->lut;
    for (int64_t i = 0; i < m; i++) {
        const double a = fabs(lr[i]);
        union { double d; int64_t i; } bits = {a};
        int64_t key = (bits.i >> shift) - base;
        key = key < 0 ? 0 : key;
        key = key > last ? last : key;
        const int64_t first = lut[key];
        const double up = lut_up[key];           /* upper[first], read beside it */
        int64_t bin = first + (a > up ? 1 : 0);
        bin = a > zero_edge ? bin : 0;
        out[i] = a > over_edge ? over : bin;
    }
}

/* With P(x) = sum_i c_i x^i = E(x^2) + O(x) (even and odd parts; O has the sign of x):
 * rho - 1 - lr = lr^2 P(lr) and exp|lr| = 1 + |lr| + lr^2 P(|lr|) = 1 + |lr| + lr^2 (E + |O|). */
static inline __attribute__((always_inline)) void series(const double *c, double lr, double *k3, double *e_abs) {
    const double x2 = lr * lr, x4 = x2 * x2;
    const double even = (c[0] + c[2] * x2) + x4 * ((c[4] + c[6] * x2) + x4 * c[8]);
    const double odd = lr * ((c[1] + c[3] * x2) + x4 * (c[5] + c[7] * x2));
    *k3 = x2 * (even + odd);
    *e_abs = 1.0 + fabs(lr) + x2 * (even + fabs(odd));
}

/* x where mask is all ones, 0 where it is 0 (a select the compiler vectorizes) */
static inline __attribute__((always_inline)) double masked(double x, int64_t mask) {
    int64_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits &= mask;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* The next m tokens of the ranges (from range *ri, token *at) into the block: values, sequence,
 * sequence cell and turn index. Returns 0 when an id is out of range (nothing read through it). */
static inline __attribute__((always_inline)) int fill_block(const TokenParams *p, const Range *ranges, int64_t n_ranges, int64_t *ri, int64_t *at,
                      int64_t m, const void *t, int t_dtype, const void *s, int s_dtype,
                      const int64_t *restrict seq, const int64_t *restrict turn,
                      const int64_t *restrict seq_cell, Block *restrict b) {
    int64_t k = 0;
    uint64_t bad = 0;
    while (k < m && *ri < n_ranges) {
        const Range rg = ranges[*ri];
        int64_t take = rg.stop - *at;
        take = take < m - k ? take : m - k;
        load_values(t, t_dtype, *at, take, b->t + k);
        load_values(s, s_dtype, *at, take, b->s + k);
        if (rg.seq >= 0) {
            bad |= (uint64_t)rg.seq >= (uint64_t)p->n_seq;
            const int64_t sq = rg.seq, sc = bad ? 0 : seq_cell[rg.seq];
            for (int64_t i = 0; i < take; i++) {
                b->seq[k + i] = sq;
                b->sc[k + i] = sc;
            }
        } else {
            if (!seq) return 0;                   /* no per-token ids to read */
            const int64_t *restrict ids = seq + *at;
            for (int64_t i = 0; i < take; i++) bad |= (uint64_t)ids[i] >= (uint64_t)p->n_seq;
            if (bad) return 0;
            for (int64_t i = 0; i < take; i++) {
                b->seq[k + i] = ids[i];
                b->sc[k + i] = seq_cell[ids[i]];
            }
        }
        if (turn) {
            memcpy(b->tb + k, turn + *at, (size_t)take * sizeof(int64_t));
        }
        k += take;
        *at += take;
        if (*at == rg.stop && ++*ri < n_ranges) *at = ranges[*ri].start;
    }
    return !bad;
}

/* exp(x) for a log-prob x <= tol (a few ulp from libm's exp; 0 below -746), branch-free so that it
 * vectorizes: x = k ln 2 + r (Cody-Waite, |r| <= ln 2 / 2), exp(r) from its Taylor series to
 * r^13 / 13! (the first term left out is below 4e-18 relative), times 2^k built from the exponent
 * bits in two halves (each a normal double, so 2^k down to the subnormals rounds only once). */
static inline __attribute__((always_inline)) double exp_logprob(double x) {
    const double lo = -746.0, xc = x < lo ? lo : (x > 1.0 ? 1.0 : x);
    /* adding 1.5 * 2^52 rounds to an integer k held in the low mantissa bits: read as bits, not
     * converted (AVX2 has no double -> int64 conversion, which would keep the loop scalar) */
    const double shifter = 0x1.8p52;
    union { double d; int64_t i; } big = {xc * 0x1.71547652b82fep0 + shifter}, base = {shifter};
    const double kd = big.d - shifter;
    const double r = (xc - kd * 0x1.62e42fee00000p-1) - kd * 0x1.a39ef35793c76p-33;
    /* Estrin's scheme (pairs, then pairs of pairs): a dependency chain of 8 operations instead
     * of Horner's 26, so that the vectorized loop is not bound by their latency */
    static const double c[14] = {1.0, 1.0, 0.5, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0,
                                 1.0 / 5040.0, 1.0 / 40320.0, 1.0 / 362880.0, 1.0 / 3628800.0,
                                 1.0 / 39916800.0, 1.0 / 479001600.0, 1.0 / 6227020800.0};
    const double r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
    const double p03 = (c[0] + c[1] * r) + r2 * (c[2] + c[3] * r);
    const double p47 = (c[4] + c[5] * r) + r2 * (c[6] + c[7] * r);
    const double p8b = (c[8] + c[9] * r) + r2 * (c[10] + c[11] * r);
    const double q = (p03 + r4 * p47) + r8 * (p8b + r4 * (c[12] + c[13] * r));
    /* k in [-1077, 2]: halved as a positive number (logical shifts only, as AVX2 has) */
    const int64_t k = big.i - base.i, k1 = (int64_t)((uint64_t)(k + 2048) >> 1) - 1024, k2 = k - k1;
    union { uint64_t u; double d; } s1 = {(uint64_t)(k1 + 1023) << 52}, s2 = {(uint64_t)(k2 + 1023) << 52};
    const double e = (q * s1.d) * s2.d;
    return x < lo ? 0.0 : e;
}

/* Straight-line loops over a block of m tokens, written for the compiler to vectorize. Rare
 * tokens are left to the scalar stage (see Block). Returns 0 when a turn index is negative, 2
 * when the block holds a rare token, 1 otherwise. */
static inline __attribute__((always_inline)) int block_values(const TokenParams *p, const double *restrict lut_up,
                                                               int64_t m, Block *b, int has_turn) {
    const double *c = p->series;
    const double tol = p->tol, lowest = -DBL_MAX;
    const double rare_abs = p->poly_max < p->outlier_abs ? p->poly_max : p->outlier_abs;
    int64_t any_rare = 0;
    for (int64_t i = 0; i < m; i++) {
        const double t = b->t[i], s = b->s[i];
        const double lr = t - s;
        double k3, e_abs;
        series(c, lr, &k3, &e_abs);
        const double rho = 1.0 + lr + k3;
        const int64_t ok = (t <= tol) & (s <= tol) & (t >= lowest) & (s >= lowest);
        const int64_t rare = !ok | (fabs(lr) >= rare_abs);
        const int64_t keep = rare - 1;            /* all ones for a token kept here */
        double *v = (double *)&b->v[i];
        v[0] = masked(1.0, keep);
        v[1] = masked(lr, keep);
        v[2] = masked(k3, keep);
        v[3] = masked(rho * rho, keep);
        b->lr[i] = masked(lr, keep);
        b->lr_mm[i] = masked(lr, keep) + masked(NAN, ~keep);
        b->e_abs[i] = masked(e_abs, keep);
        const double ps = exp_logprob(s);
        b->ps[i] = masked(ps, keep);
        b->dp[i] = masked(ps * (lr + k3), keep);  /* rho - 1 = lr + k3: no cancellation of p_T - p_S */
        any_rare |= rare;
        b->jb[i] = lr > 0;
    }
    for (int64_t e = 0; e < p->NL - 1; e++) {      /* lowprob bucket = edges <= log p */
        const double edge = p->log_edges[e];
        for (int64_t i = 0; i < m; i++) b->jb[i] += (b->s[i] >= edge) * 2;
    }
    if (has_turn) {
        uint64_t bad = 0;
        for (int64_t i = 0; i < m; i++) bad |= (uint64_t)(b->tb[i] < 0);
        if (bad) return 0;
    } else {
        memset(b->tb, 0, (size_t)m * sizeof(int64_t));
    }
    /* where a run (tokens of one sequence and turn index) starts; 1s after the block end stop
     * the search for the next start (see next_start) */
    b->brk[0] = 1;
    for (int64_t i = 1; i < m; i++) b->brk[i] = (b->seq[i] != b->seq[i - 1]) | (b->tb[i] != b->tb[i - 1]);
    memset(b->brk + m, 1, 8);
    bins_of(p, lut_up, m, b->lr_mm, b->bin);
    return 1 + (any_rare != 0);
}

/* The caller's accumulators; part of TokenPass, mirrored by native.Out (keep the order). */
typedef struct {
    int64_t *joint_n;         /* [J] count per joint bin (cell, lowprob bucket, region slot) */
    double *joint_lr, *joint_lr2, *joint_k3, *joint_exp_abs, *joint_rho2;   /* [J] sums per joint bin */
    double *min_lr, *max_lr, *seq_sum_lr, *seq_sum_exp_abs, *seq_max_abs;
    int32_t *abs_hist;
    int64_t *n_nonfinite, *n_positive, *seq_invalid;
    int64_t *n_lr_zero;       /* [cells] valid tokens with lr == 0 exactly */
    double *p_sums;           /* [N_PSUMS][cells] sums of probability-space terms (P_* below) */
    double *max_abs_dp;       /* [cells] largest |p_T - p_S| */
} Out;

/* Rows of Out.p_sums (native.PSUM_ROWS): p_S, p_T - p_S, p_S^2, p_S (p_T - p_S), (p_T - p_S)^2,
 * |p_T - p_S|; the tables derive sum p_T, p_T^2 and p_T p_S from them exactly. */
#define N_PSUMS 6

/* The probability-space terms of one token (p_S, and rho - 1 = p_T / p_S - 1) into a cell. */
static inline void add_psums(const Out *out, int64_t n_cells, int64_t cell, double ps, double rho_m1) {
    const double dp = ps * rho_m1, terms[N_PSUMS] = {ps, dp, ps * ps, ps * dp, dp * dp, fabs(dp)};
    for (int j = 0; j < N_PSUMS; j++) out->p_sums[j * n_cells + cell] += terms[j];
    if (fabs(dp) > out->max_abs_dp[cell]) out->max_abs_dp[cell] = fabs(dp);
}

/* A rare token, straight into the caller's arrays (exactly: expm1 and exp beyond the series,
 * its region by search beyond the central ones); its place in the block becomes the dump. */
static int64_t add_rare(const TokenParams *p, const double *lut_up, const Out *out, Block *b, int64_t k,
                        int64_t tb) {
    const int64_t cell = b->sc[k] * p->n_turn + tb, sq = b->seq[k], NB = p->NB, R = p->R;
    const double tv = b->t[k], sv = b->s[k];
    b->bin[k] = NB;
    if (!(isfinite(tv) && isfinite(sv))) {
        out->n_nonfinite[cell]++;
        out->seq_invalid[sq]++;
        return 0;
    }
    if (tv > p->tol || sv > p->tol) {
        out->n_positive[cell]++;
        out->seq_invalid[sq]++;
        return 0;
    }
    const double lr = tv - sv, a = fabs(lr);
    double k3, e_abs, rho2;
    if (a >= p->poly_max) {                      /* beyond the series: exactly */
        const double em1 = expm1(lr);
        k3 = em1 - lr;
        e_abs = exp(a);
        rho2 = (em1 + 1.0) * (em1 + 1.0);
    } else {
        series(p->series, lr, &k3, &e_abs);
        rho2 = (1.0 + lr + k3) * (1.0 + lr + k3);
    }
    int64_t slot = lr > 0;
    if (a >= p->outlier_abs) {                   /* first boundary >= lr: its slot */
        int64_t region = 0;
        while (region < R - 1 && p->region_bounds[region] < lr) region++;
        slot = p->slot_of_region[region];
    }
    int64_t bin;
    bins_of(p, lut_up, 1, &lr, &bin);
    out->abs_hist[cell * NB + bin]++;
    const int64_t first = cell * p->NL * R, j = first + (b->jb[k] >> 1) * R + slot;
    out->joint_n[j]++;
    out->joint_lr[j] += lr;
    out->joint_k3[j] += k3;
    out->joint_rho2[j] += rho2;
    out->joint_lr2[first] += lr * lr;          /* read per cell only: on its first bin */
    out->joint_exp_abs[first] += e_abs;
    add_psums(out, p->n_cells, cell, exp(sv), lr + k3);
    if (lr < out->min_lr[cell]) out->min_lr[cell] = lr;
    if (lr > out->max_lr[cell]) out->max_lr[cell] = lr;
    out->seq_sum_lr[sq] += lr;
    out->seq_sum_exp_abs[sq] += e_abs;
    if (a > out->seq_max_abs[sq]) out->seq_max_abs[sq] = a;
    return 1;
}

/* What the pass keeps of the current sequence cell, per turn bucket, until the next cell:
 * its central joint bins (lowprob bucket x sign, in COPIES copies: consecutive tokens add into
 * different copies), its |lr| histogram (NB bins and a dump bin) with [lo, hi] bounding the
 * bins with counts, and its running sums. Adding each token straight into the caller's
 * [cells x bins] arrays of megabytes would miss the cache on most tokens. */
typedef struct {
    V4 *joint;                /* [n_turn][COPIES][2 NL] */
    int32_t *hist;            /* [n_turn][NB + 1] */
    double *lr2, *e_abs, *min_lr, *max_lr;    /* [n_turn] each */
    V4 *psum;                 /* [n_turn][N_PSUMS + 1] lanes of the p-sums, then of max |dp| */
    int64_t *lo, *hi;
    int64_t *n_zero;          /* [n_turn] tokens with lr == 0 */
    int64_t *used;            /* turn buckets with tokens, in first-use order */
    int64_t n_used;
} Local;

static void reset_bucket(Local *L, int64_t tb, int64_t NB) {
    L->lr2[tb] = L->e_abs[tb] = 0.0;
    for (int j = 0; j <= N_PSUMS; j++) L->psum[tb * (N_PSUMS + 1) + j] = (V4){0.0, 0.0, 0.0, 0.0};
    L->min_lr[tb] = INFINITY;
    L->max_lr[tb] = -INFINITY;
    L->lo[tb] = NB;
    L->n_zero[tb] = 0;
    L->hi[tb] = -1;
}

/* Every used turn bucket of sequence cell sc into the caller's arrays; Local is empty after. */
static void end_cell(const Out *out, const TokenParams *p, int64_t sc, Local *L) {
    const int64_t NB = p->NB, NL = p->NL, R = p->R, nc = 2 * NL;
    for (int64_t u = 0; u < L->n_used; u++) {
        const int64_t tb = L->used[u], cell = sc * p->n_turn + tb;
        int32_t *h = out->abs_hist + cell * NB, *lh = L->hist + tb * (NB + 1);
        const int64_t hi = L->hi[tb] < NB - 1 ? L->hi[tb] : NB - 1;
        for (int64_t b = L->lo[tb]; b <= hi; b++) {
            h[b] += lh[b];
            lh[b] = 0;
        }
        lh[NB] = 0;
        if (L->min_lr[tb] < out->min_lr[cell]) out->min_lr[cell] = L->min_lr[tb];
        if (L->max_lr[tb] > out->max_lr[cell]) out->max_lr[cell] = L->max_lr[tb];
        const int64_t first = cell * NL * R;
        out->joint_lr2[first] += L->lr2[tb];       /* read per cell only: on its first bin */
        out->joint_exp_abs[first] += L->e_abs[tb];
        out->n_lr_zero[cell] += L->n_zero[tb];
        const V4 *lanes = L->psum + tb * (N_PSUMS + 1);
        for (int j = 0; j < N_PSUMS; j++)
            out->p_sums[j * p->n_cells + cell] += (lanes[j][0] + lanes[j][1]) + (lanes[j][2] + lanes[j][3]);
        for (int j = 0; j < 4; j++)
            if (lanes[N_PSUMS][j] > out->max_abs_dp[cell]) out->max_abs_dp[cell] = lanes[N_PSUMS][j];
        V4 *local = L->joint + tb * COPIES * nc;
        for (int64_t j = 0; j < nc; j++) {
            V4 sum = local[j];
            local[j] = (V4){0.0, 0.0, 0.0, 0.0};
            for (int c = 1; c < COPIES; c++) {
                sum += local[c * nc + j];
                local[c * nc + j] = (V4){0.0, 0.0, 0.0, 0.0};
            }
            const int64_t d = first + (j >> 1) * R + (j & 1);   /* lowprob bucket j / 2, slot lr > 0 */
            out->joint_n[d] += (int64_t)sum[0];
            out->joint_lr[d] += sum[1];
            out->joint_k3[d] += sum[2];
            out->joint_rho2[d] += sum[3];
        }
        reset_bucket(L, tb, NB);
        L->used[tb + p->n_turn] = 0;
    }
    L->n_used = 0;
}

static void end_sequence(const Out *out, int64_t seq, double sum_lr, double sum_exp_abs, double max_abs) {
    out->seq_sum_lr[seq] += sum_lr;
    out->seq_sum_exp_abs[seq] += sum_exp_abs;
    if (max_abs > out->seq_max_abs[seq]) out->seq_max_abs[seq] = max_abs;
}

/* Sums over a run of tokens [k, r) of one sequence and turn index, in four lanes. */
typedef struct {
    double lr, lr2, e_abs, min_lr, max_lr;
    int64_t lo, hi, n_zero;
} Run;

typedef int64_t V4I __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) V4 pick(V4I mask, V4 a, V4 b) {
    return (V4)(((V4I)a & mask) | ((V4I)b & ~mask));
}

static inline __attribute__((always_inline)) V4I pick_i(V4I mask, V4I a, V4I b) {
    return (a & mask) | (b & ~mask);
}

static inline __attribute__((always_inline)) Run run_sums(const Block *restrict b, int64_t k, int64_t r,
                                                          int64_t NB) {
    V4 s_lr = {0}, s_lr2 = {0}, s_e = {0};
    V4 mn = {INFINITY, INFINITY, INFINITY, INFINITY}, mx = -mn;
    V4I lo = {NB, NB, NB, NB}, hi = {-1, -1, -1, -1}, nz = {0, 0, 0, 0};
    const V4 zero = {0.0, 0.0, 0.0, 0.0};
    const V4I dump = lo;
    int64_t i = k;
    for (; i + 4 <= r; i += 4) {
        V4 x, y, e;
        V4I bin;
        memcpy(&x, b->lr + i, sizeof x);
        memcpy(&y, b->lr_mm + i, sizeof y);
        memcpy(&e, b->e_abs + i, sizeof e);
        memcpy(&bin, b->bin + i, sizeof bin);
        s_lr += x;
        s_lr2 += x * x;
        s_e += e;
        nz -= (V4I)(y == zero);                   /* -1 where lr == 0; NaN (rare) never is */
        mn = pick(y < mn, y, mn);                 /* NaN (a rare token) compares false */
        mx = pick(y > mx, y, mx);
        lo = pick_i(bin < lo, bin, lo);
        hi = pick_i((bin > hi) & (bin != dump), bin, hi);
    }
    Run out = {(s_lr[0] + s_lr[1]) + (s_lr[2] + s_lr[3]), (s_lr2[0] + s_lr2[1]) + (s_lr2[2] + s_lr2[3]),
               (s_e[0] + s_e[1]) + (s_e[2] + s_e[3]), mn[0], mx[0], lo[0], hi[0],
               (nz[0] + nz[1]) + (nz[2] + nz[3])};
    for (int j = 1; j < 4; j++) {
        out.min_lr = mn[j] < out.min_lr ? mn[j] : out.min_lr;
        out.max_lr = mx[j] > out.max_lr ? mx[j] : out.max_lr;
        out.lo = lo[j] < out.lo ? lo[j] : out.lo;
        out.hi = hi[j] > out.hi ? hi[j] : out.hi;
    }
    for (; i < r; i++) {
        const double x = b->lr[i], y = b->lr_mm[i];
        const int64_t bin = b->bin[i];
        out.lr += x;
        out.lr2 += x * x;
        out.e_abs += b->e_abs[i];
        out.n_zero += y == 0.0;
        out.min_lr = y < out.min_lr ? y : out.min_lr;
        out.max_lr = y > out.max_lr ? y : out.max_lr;
        out.lo = bin < out.lo ? bin : out.lo;
        out.hi = bin > out.hi && bin != NB ? bin : out.hi;
    }
    return out;
}

/* The probability-space sums of a run [k, r) added into the turn bucket's lanes acc[N_PSUMS], and
 * its largest |p_T - p_S| into acc[N_PSUMS] (lanes: reduced once per cell, in end_cell, not once per
 * run). A loop of its own: in run_sums' loop their accumulators would not fit the registers. Rare
 * tokens hold 0 here and add nothing. */
static inline __attribute__((always_inline)) void run_psums(const Block *restrict b, int64_t k, int64_t r,
                                                            V4 *restrict acc) {
    V4 s_ps = acc[0], s_dp = acc[1], s_ps2 = acc[2], s_psdp = acc[3], s_dp2 = acc[4], s_adp = acc[5],
       mx = acc[6];
    const V4 zero = {0.0, 0.0, 0.0, 0.0};
    int64_t i = k;
    for (; i + 4 <= r; i += 4) {
        V4 ps, dp;
        memcpy(&ps, b->ps + i, sizeof ps);
        memcpy(&dp, b->dp + i, sizeof dp);
        const V4 adp = pick((V4I)(dp < zero), -dp, dp);
        s_ps += ps;
        s_dp += dp;
        s_ps2 += ps * ps;
        s_psdp += ps * dp;
        s_dp2 += dp * dp;
        s_adp += adp;
        mx = pick((V4I)(adp > mx), adp, mx);
    }
    for (int j = 0; i < r; i++, j++) {          /* the last 1-3 tokens, one lane each */
        const double ps = b->ps[i], dp = b->dp[i], adp = fabs(dp);
        s_ps[j] += ps;
        s_dp[j] += dp;
        s_ps2[j] += ps * ps;
        s_psdp[j] += ps * dp;
        s_dp2[j] += dp * dp;
        s_adp[j] += adp;
        mx[j] = adp > mx[j] ? adp : mx[j];
    }
    acc[0] = s_ps;
    acc[1] = s_dp;
    acc[2] = s_ps2;
    acc[3] = s_psdp;
    acc[4] = s_dp2;
    acc[5] = s_adp;
    acc[6] = mx;
}

/* The turn bucket of turn index tu >= 0 (0 without turns). */
static inline __attribute__((always_inline)) int64_t turn_bucket(const TokenParams *p, const int64_t *turn_table,
                                                                 int64_t tu) {
    return turn_table ? turn_table[tu > p->turn_last ? p->turn_last : tu] : 0;
}

/* The first run start at or after i (m when none is left in the block): eight flags at a time. */
static inline __attribute__((always_inline)) int64_t next_start(const uint8_t *brk, int64_t i, int64_t m) {
    for (;; i += 8) {
        uint64_t w;
        memcpy(&w, brk + i, sizeof w);
        if (w) {
            i += __builtin_ctzll(w) >> 3;
            return i < m ? i : m;
        }
    }
}

/* Both stages over every block; built for AVX-512, for AVX2 + FMA and for baseline x86-64,
 * picked at load time. The scalar stage goes run by run (tokens of one sequence and turn
 * index, found eight start flags at a time; the turn bucket is looked up once per run): each
 * token adds its four joint values with one vector add and counts its histogram
 * bin, and a run's sums are reduced in lanes. The running values of the current sequence are
 * plain locals (registers): held in a struct whose address escapes, each += would go through
 * memory. */
CLONES_TOKEN
static int64_t token_blocks(const TokenParams *p, const Range *ranges, int64_t n_ranges, const void *t,
                            int t_dtype, const void *s, int s_dtype, const int64_t *restrict seq,
                            const int64_t *restrict turn, const int64_t *restrict seq_cell,
                            const int64_t *restrict turn_table, const double *restrict lut_up, const Out *out,
                            Local *L, Block *restrict blk) {
    const int64_t NB = p->NB, nc = 2 * p->NL, n_turn = p->n_turn;
    int64_t n = 0;
    for (int64_t i = 0; i < n_ranges; i++) n += ranges[i].stop - ranges[i].start;
    int64_t valid = 0, ri = 0, at = n_ranges ? ranges[0].start : 0;
    int64_t cur_seq = -1, cur_sc = -1;
    double seq_lr = 0.0, seq_exp = 0.0, seq_max = 0.0;
    for (int64_t done = 0; done < n;) {
        const int64_t m = n - done < BLOCK ? n - done : BLOCK;
        if (!fill_block(p, ranges, n_ranges, &ri, &at, m, t, t_dtype, s, s_dtype, seq, turn, seq_cell, blk))
            return -3;
        const int status = block_values(p, lut_up, m, blk, turn != NULL);
        if (!status) return -3;
        done += m;
        valid += m;
        if (status == 2)                        /* a rare token: NaN in lr_mm */
            for (int64_t k = 0; k < m; k++)
                if (isnan(blk->lr_mm[k])) valid += add_rare(p, lut_up, out, blk, k, turn_bucket(p, turn_table, blk->tb[k])) - 1;
        for (int64_t k = 0; k < m;) {
            const int64_t sq = blk->seq[k], tb = turn_bucket(p, turn_table, blk->tb[k]);
            const int64_t r = next_start(blk->brk, k + 1, m);
            if (sq != cur_seq) {
                if (cur_seq >= 0) end_sequence(out, cur_seq, seq_lr, seq_exp, seq_max);
                cur_seq = sq;
                seq_lr = seq_exp = seq_max = 0.0;
                if (blk->sc[k] != cur_sc) {
                    if (cur_sc >= 0) end_cell(out, p, cur_sc, L);
                    cur_sc = blk->sc[k];
                }
            }
            if (!L->used[n_turn + tb]) {
                L->used[n_turn + tb] = 1;
                L->used[L->n_used++] = tb;
            }
            V4 *restrict joint = L->joint + tb * COPIES * nc;
            int32_t *restrict hist = L->hist + tb * (NB + 1);
            for (int64_t i = k; i < r; i++) {
                joint[(i & (COPIES - 1)) * nc + blk->jb[i]] += blk->v[i];
                hist[blk->bin[i]]++;
            }
            const Run run = run_sums(blk, k, r, NB);
            run_psums(blk, k, r, L->psum + tb * (N_PSUMS + 1));
            seq_lr += run.lr;
            seq_exp += run.e_abs;
            const double run_abs = -run.min_lr > run.max_lr ? -run.min_lr : run.max_lr;
            seq_max = run_abs > seq_max ? run_abs : seq_max;
            L->lr2[tb] += run.lr2;
            L->n_zero[tb] += run.n_zero;
            L->e_abs[tb] += run.e_abs;
            L->min_lr[tb] = run.min_lr < L->min_lr[tb] ? run.min_lr : L->min_lr[tb];
            L->max_lr[tb] = run.max_lr > L->max_lr[tb] ? run.max_lr : L->max_lr[tb];
            L->lo[tb] = run.lo < L->lo[tb] ? run.lo : L->lo[tb];
            L->hi[tb] = run.hi > L->hi[tb] ? run.hi : L->hi[tb];
            k = r;
        }
    }
    if (cur_seq >= 0) end_sequence(out, cur_seq, seq_lr, seq_exp, seq_max);
    if (cur_sc >= 0) end_cell(out, p, cur_sc, L);
    return valid;
}

/* One call of the token pass, mirrored by native.TokenPass (ctypes; keep the order): what it
 * reads and the caller's arrays it adds into. native.py checks every array's dtype, length and
 * layout against TokenParams before it fills this in. */
typedef struct {
    int64_t version;                /* MM_ABI_VERSION of the caller's layout */
    const TokenParams *params;
    const Range *ranges;            /* [n_ranges] */
    int64_t n_ranges;
    const void *t, *s;              /* [N] log-probs, dtype 0 float32, 1 float64, 2 bfloat16 */
    int64_t t_dtype, s_dtype;
    const int64_t *seq;             /* [N] sequence ids (read for ranges without a sequence) */
    const int64_t *turn;            /* [N] turn index, or NULL */
    const int64_t *seq_cell;        /* [n_seq] sequence cell of each sequence */
    const int64_t *turn_table;      /* [turn_last + 1] turn bucket of each turn index, or NULL */
    Out out;
} TokenPass;

/* Every token statistic of the tokens in `ranges` ([n_ranges] Range, see there), added into
 * the caller's arrays (TokenAccumulators in token_pass.py: the five joint sums are lr, lr^2,
 * k3, exp|lr| and rho^2, where lr^2 and exp|lr| go to each cell's first bin; `abs_hist` is
 * [cells * NB] int32, for batches of fewer than 2^31 tokens). Invalid tokens (non-finite, or
 * a log-prob above tol) count per cell and per sequence and touch nothing else. Returns the
 * number of valid tokens; -1 when the series has not the N_SERIES coefficients this file was
 * compiled for, -2 when memory runs out, -3 when a sequence id or turn index is out of range
 * (nothing is read through it; the caller's arrays then hold part of the pass), -4 when the
 * caller's layout is another version's. */
int64_t mm_token_pass(const TokenPass *a) {
    if (a->version != MM_ABI_VERSION) return -4;
    const TokenParams *p = a->params;
    if (p->n_series != N_SERIES) return -1;
    const int64_t T = p->n_turn, NB = p->NB;
    const size_t n_joint = (size_t)(T * COPIES * 2 * p->NL);
    Local L = {0};
    L.joint = aligned_alloc(64, (n_joint * sizeof(V4) + 63) / 64 * 64);
    L.hist = calloc((size_t)(T * (NB + 1)), sizeof(int32_t));
    double *sums = malloc((size_t)(4 * T) * sizeof(double));
    L.psum = aligned_alloc(64, ((size_t)T * (N_PSUMS + 1) * sizeof(V4) + 63) / 64 * 64);
    int64_t *ints = calloc((size_t)(5 * T), sizeof(int64_t));
    Block *blk = aligned_alloc(64, (sizeof(Block) + 63) / 64 * 64);
    double *lut_up = malloc((size_t)p->lut_size * sizeof(double));
    int64_t valid = -2;
    if (L.joint && L.hist && sums && L.psum && ints && blk && lut_up) {
        for (int64_t key = 0; key < p->lut_size; key++) lut_up[key] = p->upper[p->lut[key]];
        memset(L.joint, 0, n_joint * sizeof(V4));
        L.lr2 = sums;
        L.e_abs = sums + T;
        L.min_lr = sums + 2 * T;
        L.max_lr = sums + 3 * T;
        L.lo = ints;
        L.hi = ints + T;
        L.used = ints + 2 * T;        /* [T] the list, then [T] flags */
        L.n_zero = ints + 4 * T;
        for (int64_t tb = 0; tb < T; tb++) reset_bucket(&L, tb, NB);
        valid = token_blocks(p, a->ranges, a->n_ranges, a->t, (int)a->t_dtype, a->s, (int)a->s_dtype, a->seq,
                             a->turn, a->seq_cell, a->turn_table, lut_up, &a->out, &L, blk);
    }
    free(L.joint);
    free(L.hist);
    free(L.psum);
    free(sums);
    free(ints);
    free(blk);
    free(lut_up);
    return valid;
}

/* ------------------------------------------------------------------ non-zero entries */

/* The non-zero entries of a [rows x width] array (`size` bytes each: 4 or 8) as (row, column,
 * value) triples in row-major order, into arrays of at least count + 1 entries (each entry is
 * written before the count decides whether it stays); `count` from mm_count_nonzero. */
int64_t mm_count_nonzero(const void *values, int64_t n, int64_t size) {
    int64_t k = 0;
    if (size == 4) {
        const int32_t *v = values;
        for (int64_t i = 0; i < n; i++) k += v[i] != 0;
    } else {
        const int64_t *v = values;
        for (int64_t i = 0; i < n; i++) k += v[i] != 0;
    }
    return k;
}

#define NZ_GROUP 16

static inline int64_t entry(const void *values, int64_t size, int64_t i) {
    return size == 4 ? ((const int32_t *)values)[i] : ((const int64_t *)values)[i];
}

/* Groups of NZ_GROUP entries without a non-zero one (most of a sparse histogram) are skipped
 * after one vectorized test; the others go entry by entry, branch-free. */
int64_t mm_nonzero_rows(const void *values, int64_t rows, int64_t width, int64_t size, int64_t *row, int64_t *col,
                        int64_t *val) {
    int64_t k = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * width;
        for (int64_t c0 = 0; c0 < width; c0 += NZ_GROUP) {
            const int64_t end = c0 + NZ_GROUP < width ? c0 + NZ_GROUP : width;
            if (end - c0 == NZ_GROUP) {
                int64_t any = 0;
                if (size == 4) {
                    const int32_t *v = (const int32_t *)values + base + c0;
                    for (int j = 0; j < NZ_GROUP; j++) any |= v[j];
                } else {
                    const int64_t *v = (const int64_t *)values + base + c0;
                    for (int j = 0; j < NZ_GROUP; j++) any |= v[j];
                }
                if (!any) continue;
            }
            for (int64_t c = c0; c < end; c++) {
                const int64_t v = entry(values, size, base + c);
                row[k] = r;
                col[k] = c;
                val[k] = v;
                k += v != 0;
            }
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

/* out[i] = v[idx[i]] for 16 byte lanes (idx < 16): GCC's generic shuffle, else a lane loop
 * (clang's vector extension has no shuffle with run-time indices; the loop is exact on every
 * target, and only the top-8 byte routing path uses it). */
static inline V16 permute16(V16 v, V16 idx) {
#if defined(__GNUC__) && !defined(__clang__) && !defined(MM_PORTABLE)
    return __builtin_shuffle(v, idx);
#else
    unsigned char in[16], ix[16], out[16];
    memcpy(in, &v, 16);
    memcpy(ix, &idx, 16);
    for (int i = 0; i < 16; i++) out[i] = in[ix[i] & 15];
    V16 w;
    memcpy(&w, out, 16);
    return w;
#endif
}

static inline int differ_top8_bytes(const unsigned char *tr, const unsigned char *sr, const ByteLayers *bl) {
    V16 v;
    memcpy(&v, tr, 8);
    memcpy((unsigned char *)&v + 8, sr, 8);
    for (int64_t l = 0; l < bl->n; l++) {
        const V16 w = permute16(v, bl->partner[l]);
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
 * of flips, -1 when K is above the supported 64 (or the byte layers above 16), -2 when a cell
 * is outside [0, n_cells) (the caller's arrays then hold part of the count). */
CLONES_ROUTING
static int64_t routing_loop(int64_t n, int64_t L, int64_t K, int64_t size, const void *trainer,
                            const void *sampler, const int64_t *cell, int64_t n_cells, const Network *net,
                            int64_t *per_layer, int64_t *any_flip) {
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
        if ((uint64_t)c >= (uint64_t)n_cells) return -2;
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
                         const void *sampler, const int64_t *cell, int64_t n_cells, const Network *net,
                         int64_t *per_layer, int64_t *any_flip) {
    return routing_loop(n, L, K, size, trainer, sampler, cell, n_cells, net, per_layer, any_flip);
}

/* ------------------------------------------------------------------ module */

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Compiled loops of the metric engine; called through ctypes (see engine/native.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
