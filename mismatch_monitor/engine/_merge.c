/* The writer rank's merge of packed shards (collectors/rank_merge.py): its loops over cells and
 * rows, called through ctypes from native_merge.py, which checks every array first.
 *
 * Cells get one code each, a mixed radix over their keys' codes; the cells are grouped by it
 * (in numpy: a few thousand cells). Then group by group: the rows of the group's cells (in
 * part order) go to slots by their row key above the group's lowest, and each value column is
 * merged into the slots by its rule, in row order, as numpy's bincount and fmax.at / fmin.at do
 * in engine/groupby.py: the same additions in the same order, so the same bits.
 *
 * The slots are taken in tiles of consecutive groups that stay in cache (each part's cells come
 * in group order, as the engine writes them: a tile is a stretch of each part's rows, read in
 * order); a part whose cells do not makes the whole table one tile. The merged rows are written
 * in order, the slots no row reached left out.
 *
 * Element kinds: 0 int8, 1 int16, 2 int32, 3 int64, 4 float64. Rules: 0 sum (int64 for
 * integers, float64 for floats), 1 max, 2 min (float64, NaN where no value came; a NaN value is
 * skipped). A negative return is a malformed input; nothing outside the arrays is written. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MM_MERGE_VERSION 5

int64_t mm_merge_version(void) { return MM_MERGE_VERSION; }

enum { KIND_I8, KIND_I16, KIND_I32, KIND_I64, KIND_F64 };
enum { RULE_SUM, RULE_MAX, RULE_MIN };

static inline int64_t load_int(const void *a, int32_t kind, int64_t i) {
    switch (kind) {
    case KIND_I8: return ((const int8_t *)a)[i];
    case KIND_I16: return ((const int16_t *)a)[i];
    case KIND_I32: return ((const int32_t *)a)[i];
    default: return ((const int64_t *)a)[i];
    }
}

/* Cell codes (code [n_cells]): cell i of part p (parts' cells one after another, part_cells[p]
 * each) has, for key k, the code lut_k[value + shift_k[p]], and its code is the mixed radix
 * sum_k code_k * prod_{j > k} radix_j (every lut_k entry below radix_k). */
int64_t mm_merge_cell_codes(int64_t n_cells, int64_t n_parts, const int64_t *part_cells, int64_t n_keys,
                            const int64_t *keys, const int32_t *kinds, const int64_t *luts,
                            const int64_t *lut_sizes, const int64_t *shifts, const int64_t *radix, int64_t *code) {
    memset(code, 0, (size_t)n_cells * sizeof(int64_t));
    for (int64_t k = 0; k < n_keys; k++) {
        const void *key = (const void *)keys[k];
        const int64_t *lut = (const int64_t *)luts[k], *shift = (const int64_t *)shifts[k];
        int64_t i = 0;
        for (int64_t p = 0; p < n_parts; p++) {
            int64_t end = i + part_cells[p];
            if (end > n_cells) return -1;
            for (; i < end; i++) {
                int64_t at = load_int(key, kinds[k], i) + shift[p];
                if ((uint64_t)at >= (uint64_t)lut_sizes[k]) return -1;
                code[i] = code[i] * radix[k] + lut[at];
            }
        }
        if (i != n_cells) return -1;
    }
    return 0;
}

/* One table's rows, grouped (the layout of native_merge.Groups). */
typedef struct {
    int64_t n_cells, n_groups, n_rows, n_parts;
    const int64_t *part_cells;   /* [n_parts] each part's cells (the parts' cells follow one another) */
    const int64_t *group;        /* [n_cells] each cell's group, 0..n_groups-1 */
    const int64_t *run;          /* [n_cells] each cell's rows (they follow one another); NULL: one */
    const void *key;             /* [n_rows] the row key, of key_kind; NULL: none (a row per group) */
    int64_t key_kind;
    const int64_t *lo, *hi;      /* [n_cells] each cell's lowest and highest row key (with key) */
    int64_t n_cols;
    const int64_t *values;       /* [n_cols] addresses of the [n_rows] value columns */
    const int64_t *kinds, *rules;
    int64_t capacity;            /* merged rows the outputs hold */
    int64_t *out_key;            /* [capacity] each merged row's key (with key) */
    int64_t *out_runs;           /* [n_groups] each group's merged rows */
    const int64_t *out;          /* [n_cols] addresses of [capacity] int64 (integer sums) or float64 */
} Groups;

/* slots of a tile: its accumulators stay in L2 (with at least one group per tile) */
#define TILE_BYTES (192 * 1024)

/* The rows of the tile: part p's rows rows[2p]..rows[2p + 1] (its cells of the tile's groups),
 * the t-th of them in slot[t] of the tile. */
#define ROWS(BODY)                                                                   \
    for (int64_t p = 0, t = 0; p < n_parts; p++)                                     \
        for (int64_t r = rows[2 * p], end = rows[2 * p + 1]; r < end; r++, t++) {   \
            int32_t s = slot[t];                                                     \
            BODY;                                                                    \
        }
#define SUM_INT(T) ROWS(ai[s] = (int64_t)((uint64_t)ai[s] + (uint64_t)(int64_t)((const T *)v)[r]))
/* fmax.at / fmin.at: a NaN value leaves the slot as it is, a NaN slot takes the value, and an
 * equal value replaces the slot's (numpy's indexed loop: -0.0 after 0.0 gives -0.0) */
#define EXTREME(T, CMP) ROWS(double x = (double)((const T *)v)[r]; if (x CMP af[s] || isnan(af[s])) af[s] = x)
#define BY_KIND(MACRO, ...)                                                          \
    switch (kind) {                                                                  \
    case KIND_I8: MACRO(int8_t __VA_ARGS__); break;                                  \
    case KIND_I16: MACRO(int16_t __VA_ARGS__); break;                                \
    case KIND_I32: MACRO(int32_t __VA_ARGS__); break;                                \
    case KIND_I64: MACRO(int64_t __VA_ARGS__); break;                                \
    case KIND_F64: MACRO(double __VA_ARGS__); break;                                 \
    default: return -1;                                                              \
    }

/* One column (v, of kind) over one tile's rows into acc [span], set here. */
static int merge_tile(int64_t n_parts, const int64_t *rows, const int32_t *slot, const void *v, int64_t kind,
                      int64_t rule, int64_t span, void *acc) {
    int64_t *ai = (int64_t *)acc;
    double *af = (double *)acc;
    if (rule == RULE_SUM && kind == KIND_F64) {
        for (int64_t s = 0; s < span; s++) af[s] = 0.0;
        ROWS(af[s] += ((const double *)v)[r])
    } else if (rule == RULE_SUM) {
        for (int64_t s = 0; s < span; s++) ai[s] = 0;
        if (kind == KIND_F64) return -1;
        BY_KIND(SUM_INT)
    } else if (rule == RULE_MAX || rule == RULE_MIN) {
        for (int64_t s = 0; s < span; s++) af[s] = NAN;
        if (rule == RULE_MAX) {
            BY_KIND(EXTREME, , >=)
        } else {
            BY_KIND(EXTREME, , <=)
        }
    } else {
        return -1;
    }
    return 0;
}

/* A cell's rows r0..r1 into slots b + KEY (each within the cell's range lo..hi), marked; locals
 * only in the loop (a store to mark may alias any array behind a pointer). */
#define MARK(KEY)                                                                    \
    for (int64_t r = r0; r < r1; r++) {                                              \
        int64_t k = (KEY);                                                           \
        if (k < lo || k > hi) goto done;                                             \
        to[r - r0] = (int32_t)(b + k);                                               \
        mark[b + k] = 1;                                                             \
    }

/* The merged rows of every group, in group order and within a group in row-key order (the
 * slots no row reached left out). Returns how many, or -1 (a malformed input: a group without
 * a cell, a row key outside its cell's range, a kind or rule without a loop, too many rows). */
int64_t mm_merge_groups(const Groups *a) {
    int64_t G = a->n_groups, C = a->n_cells, P = a->n_parts, result = -1, rows = 0;
    int32_t key_kind = (int32_t)a->key_kind;
    const void *key = a->key;
    int64_t *start = malloc((size_t)(C + 1) * sizeof(int64_t));
    int64_t *low = malloc((size_t)(G + 1) * sizeof(int64_t)), *offset = malloc((size_t)(G + 1) * sizeof(int64_t));
    int64_t *cursor = malloc((size_t)(6 * P + 2) * sizeof(int64_t)), capacity = 0;
    int32_t *slot = NULL;
    uint8_t *mark = NULL;
    char *acc = NULL;
    if (!start || !low || !offset || !cursor) goto done;
    int64_t *high = offset + 1, *first = cursor + P, *last = cursor + 2 * P, *bound = cursor + 3 * P, *rows_of = cursor + 4 * P + 1;
    for (int64_t g = 0; g < G; g++) {
        low[g] = a->key ? INT64_MAX : 0;
        high[g] = a->key ? INT64_MIN : -1;
    }
    /* row starts, each group's span of row keys, and whether each part's cells come in group order */
    int ordered = 1;
    start[0] = 0;
    bound[P] = C;
    for (int64_t p = 0, c = 0; p < P; p++) {
        cursor[p] = bound[p] = c;
        for (int64_t end = c + a->part_cells[p]; c < end; c++) {
            int64_t g = a->group[c], n = a->run ? a->run[c] : 1;
            if (end > C || (uint64_t)g >= (uint64_t)G || n < 1) goto done;
            if (c > cursor[p] && g < a->group[c - 1]) ordered = 0;
            start[c + 1] = start[c] + n;
            int64_t l = a->key ? a->lo[c] : 0, h = a->key ? a->hi[c] : 0;
            if (l > h) goto done;
            if (l < low[g]) low[g] = l;
            if (h > high[g]) high[g] = h;
        }
    }
    if (P == 0 || cursor[P - 1] + a->part_cells[P - 1] != C) goto done;
    if (start[C] != a->n_rows) goto done;
    /* the groups' offsets, their spans in place of their highest keys */
    offset[0] = 0;
    int64_t max_span = 1;
    for (int64_t g = 0; g < G; g++) {
        if (high[g] < low[g] || high[g] - low[g] >= INT32_MAX) goto done;     /* no cell, or too wide */
        int64_t span = high[g] - low[g] + 1;
        offset[g + 1] = offset[g] + span;
        if (span > max_span) max_span = span;
    }
    int64_t width = a->n_cols ? a->n_cols : 1;
    int64_t tile_slots = TILE_BYTES / (8 * width);
    if (tile_slots < max_span) tile_slots = max_span;
    if (!ordered && tile_slots < offset[G]) tile_slots = offset[G];
    if (a->key && (key_kind < KIND_I8 || key_kind > KIND_I64)) goto done;
    mark = malloc((size_t)tile_slots);
    acc = malloc((size_t)tile_slots * 8 * (size_t)width);
    if (!mark || !acc) goto done;
    for (int64_t g0 = 0; g0 < G;) {
        int64_t g1 = g0;
        while (g1 < G && offset[g1 + 1] - offset[g0] <= tile_slots) g1++;
        int64_t span = offset[g1] - offset[g0];
        /* each part's cells of the tile's groups and their rows, each row's slot in the tile, marked */
        int64_t n = 0;
        for (int64_t p = 0; p < P; p++) {
            int64_t c = cursor[p], end = bound[p + 1];
            first[p] = c;
            while (c < end && (!ordered || a->group[c] < g1)) c++;
            last[p] = c;
            rows_of[2 * p] = start[first[p]];
            rows_of[2 * p + 1] = start[c];
            n += start[c] - start[first[p]];
        }
        if (n > capacity) {
            int32_t *grown = realloc(slot, (size_t)n * sizeof(int32_t));
            if (!grown) goto done;
            slot = grown;
            capacity = n;
        }
        memset(mark, 0, (size_t)span);
        for (int64_t p = 0, t = 0; p < P; p++)
            for (int64_t c = first[p]; c < last[p]; c++) {
                int64_t g = a->group[c], b = offset[g] - offset[g0] - low[g];
                int64_t lo = a->key ? a->lo[c] : 0, hi = a->key ? a->hi[c] : 0, r0 = start[c], r1 = start[c + 1];
                int32_t *to = slot + t;
                t += r1 - r0;
                switch (a->key ? key_kind : -1) {
                case -1: MARK(0) break;
                case KIND_I8: MARK(((const int8_t *)key)[r]) break;
                case KIND_I16: MARK(((const int16_t *)key)[r]) break;
                case KIND_I32: MARK(((const int32_t *)key)[r]) break;
                default: MARK(((const int64_t *)key)[r]) break;
                }
            }
        for (int64_t j = 0; j < a->n_cols; j++)
            if (merge_tile(P, rows_of, slot, (const void *)a->values[j], a->kinds[j], a->rules[j], span,
                           acc + (size_t)j * (size_t)tile_slots * 8))
                goto done;
        for (int64_t g = g0; g < g1; g++) {
            int64_t before = rows;
            for (int64_t s = offset[g] - offset[g0]; s < offset[g + 1] - offset[g0]; s++) {
                if (!mark[s]) continue;
                if (rows >= a->capacity) goto done;
                if (a->out_key) a->out_key[rows] = low[g] + s - (offset[g] - offset[g0]);
                for (int64_t j = 0; j < a->n_cols; j++)
                    ((int64_t *)a->out[j])[rows] = ((const int64_t *)(acc + (size_t)j * (size_t)tile_slots * 8))[s];
                rows++;
            }
            a->out_runs[g] = rows - before;
        }
        for (int64_t p = 0; p < P; p++) cursor[p] = last[p];
        if (!ordered) break;
        g0 = g1;
    }
    result = rows;
done:
    free(start); free(low); free(offset); free(cursor); free(slot); free(mark); free(acc);
    return result;
}
