/* The padded layout's rows, read once (mismatch_monitor/padded_native.py calls these through
 * ctypes; batch_layout.py falls back to numpy where this is not built).
 *
 * mm_padded_rows: per row of a [B, T] integer or bool response mask, its number of non-zero
 * slots and its first one, and whether every row's slots are one run (first .. first + count).
 * A slot is a token when its value is non-zero, the test `mask.to(torch.bool)` makes: on the
 * bits, which for integers and bools is the value.
 *
 * mm_gather_runs: each row's run of slots copied out of a [B, T, ...] tensor into a flat
 * [N, ...] one, rows one after the other (what `t[mask]` gives when each row is one run).
 *
 * Plain C, no allocation: the caller passes every output. A large output is marked for
 * transparent huge pages first (where the kernel has them): a fresh buffer of tens of MB is
 * otherwise written at the speed of its 4 KiB page faults, 2-3x slower than the copy itself
 * (measured: 14 ms against 5 ms for 20 MB). */

#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#define MM_PADDED_VERSION 2

/* x86-64 builds an AVX2 copy of the scan beside the baseline one (SSE2 has no 64-bit compare:
 * verl's int64 mask would be read at a quarter of the speed), chosen at load time */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

int64_t mm_padded_version(void) { return MM_PADDED_VERSION; }

/* count, first and run check of one row of element type T_ */
#define ROW_SCAN(T_)                                                                    \
    static inline __attribute__((always_inline)) int row_##T_(const T_ *restrict m, int64_t n_slots, int64_t *count, int64_t *first) { \
        int64_t n = 0;                                                                  \
        for (int64_t i = 0; i < n_slots; i++) n += m[i] != 0;                           \
        *count = n;                                                                     \
        if (n == 0) {                                                                   \
            *first = 0;                                                                 \
            return 1;                                                                   \
        }                                                                               \
        int64_t f = 0;                                                                  \
        while (m[f] == 0) f++;                                                          \
        *first = f;                                                                     \
        if (f + n > n_slots) return 0;                                                  \
        int all = 1;                                                                    \
        for (int64_t i = f; i < f + n; i++) all &= m[i] != 0;                           \
        return all;                                                                     \
    }

ROW_SCAN(uint8_t)
ROW_SCAN(uint16_t)
ROW_SCAN(uint32_t)
ROW_SCAN(uint64_t)

/* `mask`: B rows of T elements of `width` bytes (1, 2, 4 or 8), row r at mask + r * stride
 * elements. Fills counts[B] and firsts[B] (0 for an empty row). Returns 1 when every row is one
 * run, 0 when some row is not (counts are right either way), -1 for a width it does not read. */
CLONES int64_t mm_padded_rows(const void *mask, int64_t width, int64_t B, int64_t T, int64_t stride,
                       int64_t *restrict counts, int64_t *restrict firsts) {
    int runs = 1;
    for (int64_t b = 0; b < B; b++) {
        switch (width) {
        case 1: runs &= row_uint8_t((const uint8_t *)mask + b * stride, T, counts + b, firsts + b); break;
        case 2: runs &= row_uint16_t((const uint16_t *)mask + b * stride, T, counts + b, firsts + b); break;
        case 4: runs &= row_uint32_t((const uint32_t *)mask + b * stride, T, counts + b, firsts + b); break;
        case 8: runs &= row_uint64_t((const uint64_t *)mask + b * stride, T, counts + b, firsts + b); break;
        default: return -1;
        }
    }
    return runs;
}

/* Row b's slots [firsts[b], firsts[b] + counts[b]) of `src` (row b at src + b * row_bytes,
 * slots of `slot_bytes` each) one after the other into `out`, of `out_bytes` (their sum). */
void mm_gather_runs(const void *src, int64_t slot_bytes, int64_t B, int64_t row_bytes,
                    const int64_t *restrict counts, const int64_t *restrict firsts, void *out,
                    int64_t out_bytes) {
    const char *s = (const char *)src;
    char *o = (char *)out;
#if defined(MADV_HUGEPAGE)
    {
        const uintptr_t huge = (uintptr_t)2 << 20;
        const uintptr_t lo = ((uintptr_t)o + huge - 1) & ~(huge - 1);
        const uintptr_t hi = ((uintptr_t)o + (uintptr_t)out_bytes) & ~(huge - 1);
        /* advice only: where it is refused the copy below is the same, only slower */
        if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
    }
#endif
    for (int64_t b = 0; b < B; b++) {
        const size_t n = (size_t)(counts[b] * slot_bytes);
        if (n) memcpy(o, s + b * row_bytes + firsts[b] * slot_bytes, n);
        o += n;
    }
}
