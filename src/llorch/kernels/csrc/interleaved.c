/* Kernels for the interleaved layouts of repack.c (VNNI variants only).
 *
 * Why: a row-at-a-time kernel adds up each block's eight lanes and scales every (activation
 * row, weight row) pair on its own; here the eight lanes are eight weight rows, so a block
 * costs eight dot instructions per activation row and its scaling is shared by the eight
 * rows. Measured on Q8_0 (one thread, Zen 4): 16 activation rows 0.43 ns per block and row
 * against 0.84 row at a time; one row 1.74 against 1.9.
 *
 * Every output is each block's (or sub-block's) exact integer dot, then float multiply-adds
 * in one fixed order per activation row, so a row's result does not depend on its batch.
 */
#include "simd.h"

#ifdef LLORCH_VNNI
#define TILE 4
#define ROWS 8

/* Activation values 4c..4c+3 in every lane. */
static inline __m256i step_of(const act_block *a, int c) {
    int32_t four;
    memcpy(&four, a->q + 4 * c, 4);
    return _mm256_set1_epi32(four);
}

static inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
static inline __m256i high_nibbles(__m256i v) { return low_nibbles(_mm256_srli_epi16(v, 4)); }

/* Q8_0_R8 and Q5_0_R8: per 32-value block, steps v[0..8) of unsigned values w + offset. */
static inline __attribute__((always_inline)) void small_blocks(int type, const uint8_t *w, int64_t k, int64_t j0,
                                                             int64_t j1, const act_block *const *x, int tile,
                                                             float *out, int64_t ldo, int ahead) {
    const int64_t blocks = k / QK, group_bytes = llorch_group_bytes(type);
    const float offset = type == T_Q8_0_R8 ? 128.0f : 16.0f;
    for (int64_t g = j0 / ROWS; g < j1 / ROWS; g++) {
        __m256 acc[TILE], offsets[TILE];
        for (int t = 0; t < tile; t++) acc[t] = offsets[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *group = w + (g * blocks + b) * group_bytes;
            if (ahead) prefetch_ahead(group, group_bytes);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)group));
            const __m256 shift = _mm256_mul_ps(d, _mm256_set1_ps(offset));
            __m256i v[8];
            if (type == T_Q8_0_R8) {
                for (int c = 0; c < 8; c++) v[c] = _mm256_loadu_si256((const __m256i *)(group + 16 + 32 * c));
            } else {
                for (int c = 0; c < 4; c++) {
                    const __m256i packed = _mm256_loadu_si256((const __m256i *)(group + 16 + 32 * c));
                    v[c] = low_nibbles(packed);
                    v[c + 4] = high_nibbles(packed);
                }
                for (int c = 0; c < 8; c++) {
                    uint32_t fifth;
                    memcpy(&fifth, group + 144 + 4 * c, 4);
                    v[c] = _mm256_mask_add_epi8(v[c], _cvtu32_mask32(fifth), v[c], _mm256_set1_epi8(16));
                }
            }
            for (int t = 0; t < tile; t++) {
                const act_block *a = x[t] + b;
                /* Two chains of dot instructions, not one: their latency, not their count, bounds one row. */
                __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
                for (int c = 0; c < 8; c += 2) {
                    even = _mm256_dpbusd_epi32(even, v[c], step_of(a, c));
                    odd = _mm256_dpbusd_epi32(odd, v[c + 1], step_of(a, c + 1));
                }
                const __m256i lanes = _mm256_add_epi32(even, odd);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_mul_ps(d, _mm256_set1_ps(a->d)), acc[t]);
                offsets[t] = _mm256_fmadd_ps(shift, _mm256_set1_ps(a->d * (float)(a->sum[0] + a->sum[1])), offsets[t]);
            }
        }
        for (int t = 0; t < tile; t++) _mm256_storeu_ps(out + t * ldo + ROWS * g, _mm256_sub_ps(acc[t], offsets[t]));
    }
}

/* Eight bytes of per-row 8-bit values as eight floats. */
static inline __m256 unsigned_bytes(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Q4_K_R8: per super-block of 256, d * sum_j dx_j * scale_j * dot_j - dmin * sum_j dx_j * min_j * xsum_j. */
static inline __attribute__((always_inline)) void q4_k(const uint8_t *w, int64_t k, int64_t j0, int64_t j1,
                                                     const act_block *const *x, int tile, float *out, int64_t ldo,
                                                     int ahead) {
    const int64_t supers = k / QK_K, group_bytes = llorch_group_bytes(T_Q4_K_R8);
    for (int64_t g = j0 / ROWS; g < j1 / ROWS; g++) {
        __m256 total[TILE];
        for (int t = 0; t < tile; t++) total[t] = _mm256_setzero_ps();
        for (int64_t s = 0; s < supers; s++) {
            const uint8_t *group = w + (g * supers + s) * group_bytes;
            if (ahead) prefetch_ahead(group, group_bytes);
            /* The 6-bit scales and minimums of all eight rows at once (k4_scale_min's unpacking). */
            const __m256i a = _mm256_loadu_si256((const __m256i *)(group + 32));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(group + 64));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(group + 96));
            const __m256i six = _mm256_set1_epi8(63), top = _mm256_set1_epi8(0x30);
            uint8_t unpacked[4][32];  /* scales 0-3, 4-7, minimums 0-3, 4-7: [sub-block][row] */
            _mm256_storeu_si256((__m256i *)unpacked[0], _mm256_and_si256(a, six));
            _mm256_storeu_si256((__m256i *)unpacked[1],
                                _mm256_or_si256(low_nibbles(c), _mm256_and_si256(_mm256_srli_epi16(a, 2), top)));
            _mm256_storeu_si256((__m256i *)unpacked[2], _mm256_and_si256(b, six));
            _mm256_storeu_si256((__m256i *)unpacked[3],
                                _mm256_or_si256(high_nibbles(c), _mm256_and_si256(_mm256_srli_epi16(b, 2), top)));
            __m256 scale[8], min[8];
            for (int j = 0; j < 8; j++) {
                scale[j] = unsigned_bytes(unpacked[j / 4] + 8 * (j % 4));
                min[j] = unsigned_bytes(unpacked[2 + j / 4] + 8 * (j % 4));
            }
            __m256 acc[TILE], mins[TILE];
            for (int t = 0; t < tile; t++) acc[t] = mins[t] = _mm256_setzero_ps();
            for (int p = 0; p < 4; p++) {  /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
                __m256i even[TILE], odd[TILE];
                for (int t = 0; t < tile; t++) even[t] = odd[t] = _mm256_setzero_si256();
                for (int step = 0; step < 8; step++) {
                    const __m256i packed = _mm256_loadu_si256((const __m256i *)(group + 128 + (8 * p + step) * 32));
                    const __m256i lo = low_nibbles(packed), hi = high_nibbles(packed);
                    for (int t = 0; t < tile; t++) {
                        const act_block *first = x[t] + s * 8 + 2 * p;
                        even[t] = _mm256_dpbusd_epi32(even[t], lo, step_of(first, step));
                        odd[t] = _mm256_dpbusd_epi32(odd[t], hi, step_of(first + 1, step));
                    }
                }
                for (int t = 0; t < tile; t++) {
                    const act_block *first = x[t] + s * 8 + 2 * p, *second = first + 1;
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(even[t]),
                                             _mm256_mul_ps(scale[2 * p], _mm256_set1_ps(first->d)), acc[t]);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(odd[t]),
                                             _mm256_mul_ps(scale[2 * p + 1], _mm256_set1_ps(second->d)), acc[t]);
                    mins[t] = _mm256_fmadd_ps(min[2 * p], _mm256_set1_ps(first->d * (float)(first->sum[0] + first->sum[1])),
                                              mins[t]);
                    mins[t] = _mm256_fmadd_ps(min[2 * p + 1],
                                              _mm256_set1_ps(second->d * (float)(second->sum[0] + second->sum[1])), mins[t]);
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)group));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(group + 16)));
            for (int t = 0; t < tile; t++) total[t] = _mm256_fnmadd_ps(dmin, mins[t], _mm256_fmadd_ps(d, acc[t], total[t]));
        }
        for (int t = 0; t < tile; t++) _mm256_storeu_ps(out + t * ldo + ROWS * g, total[t]);
    }
}

/* The 2-bit high parts of step `p` (0..3) of a 32-byte plane, at bits 4-5 of each byte. */
static inline __m256i high_pair(__m256i plane, int p) {
    const __m256i placed = p == 0 ? _mm256_slli_epi16(plane, 4)
                         : p == 1 ? _mm256_slli_epi16(plane, 2)
                         : p == 2 ? plane
                                  : _mm256_srli_epi16(plane, 2);
    return _mm256_and_si256(placed, _mm256_set1_epi8(0x30));
}

/* Q6_K_R8: per 16 values an 8-bit scale, all integer within each 32 values (exact: at most
 * 2 x 16 x 32 x 127 x 128 < 2^24, so the float conversion is exact too). */
static inline __attribute__((always_inline)) void q6_k(const uint8_t *w, int64_t k, int64_t j0, int64_t j1,
                                                     const act_block *const *x, int tile, float *out, int64_t ldo,
                                                     int ahead) {
    const int64_t supers = k / QK_K, group_bytes = llorch_group_bytes(T_Q6_K_R8);
    for (int64_t g = j0 / ROWS; g < j1 / ROWS; g++) {
        __m256 total[TILE];
        for (int t = 0; t < tile; t++) total[t] = _mm256_setzero_ps();
        for (int64_t s = 0; s < supers; s++) {
            const uint8_t *group = w + (g * supers + s) * group_bytes;
            if (ahead) prefetch_ahead(group, group_bytes);
            __m256 acc[TILE];
            for (int t = 0; t < tile; t++) acc[t] = _mm256_setzero_ps();
            for (int b = 0; b < 8; b++) {
                const uint8_t *part = group + 144 + b * 192;
                const __m256i scale0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(group + 16 + 16 * b)));
                const __m256i scale1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(group + 24 + 16 * b)));
                const __m256i high0 = _mm256_loadu_si256((const __m256i *)(part + 128));
                const __m256i high1 = _mm256_loadu_si256((const __m256i *)(part + 160));
                __m256i v[8];
                for (int p = 0; p < 4; p++) {
                    const __m256i low = _mm256_loadu_si256((const __m256i *)(part + 32 * p));
                    v[p] = _mm256_or_si256(low_nibbles(low), high_pair(high0, p));
                    v[p + 4] = _mm256_or_si256(high_nibbles(low), high_pair(high1, p));
                }
                for (int t = 0; t < tile; t++) {
                    const act_block *a = x[t] + s * 8 + b;
                    __m256i first = _mm256_set1_epi32(-32 * a->sum[0]), second = _mm256_set1_epi32(-32 * a->sum[1]);
                    for (int c = 0; c < 4; c++) first = _mm256_dpbusd_epi32(first, v[c], step_of(a, c));
                    for (int c = 4; c < 8; c++) second = _mm256_dpbusd_epi32(second, v[c], step_of(a, c));
                    const __m256i both = _mm256_add_epi32(_mm256_mullo_epi32(first, scale0), _mm256_mullo_epi32(second, scale1));
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), _mm256_set1_ps(a->d), acc[t]);
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)group));
            for (int t = 0; t < tile; t++) total[t] = _mm256_fmadd_ps(d, acc[t], total[t]);
        }
        for (int t = 0; t < tile; t++) _mm256_storeu_ps(out + t * ldo + ROWS * g, total[t]);
    }
}

#define BY_TILE(call_with_tile)            \
    switch (tile) {                        \
        case 1: call_with_tile(1); break;  \
        case 2: call_with_tile(2); break;  \
        case 3: call_with_tile(3); break;  \
        default: call_with_tile(TILE); break; \
    }

void llorch_interleaved_rows(int type, const uint8_t *w, int64_t k, int64_t j0, int64_t j1, const act_block *const *x,
                             int tile, float *out, int64_t ldo, int ahead) {
/* `ahead` as a constant in each inlined copy: a flag tested inside the loops cost the
 * compute-bound prompt tiles a few percent. */
#define Q8(n) ahead ? small_blocks(T_Q8_0_R8, w, k, j0, j1, x, n, out, ldo, 1) \
                    : small_blocks(T_Q8_0_R8, w, k, j0, j1, x, n, out, ldo, 0)
#define Q5(n) ahead ? small_blocks(T_Q5_0_R8, w, k, j0, j1, x, n, out, ldo, 1) \
                    : small_blocks(T_Q5_0_R8, w, k, j0, j1, x, n, out, ldo, 0)
#define Q4K(n) ahead ? q4_k(w, k, j0, j1, x, n, out, ldo, 1) : q4_k(w, k, j0, j1, x, n, out, ldo, 0)
#define Q6K(n) ahead ? q6_k(w, k, j0, j1, x, n, out, ldo, 1) : q6_k(w, k, j0, j1, x, n, out, ldo, 0)
    switch (type) {
        case T_Q8_0_R8: BY_TILE(Q8); break;
        case T_Q5_0_R8: BY_TILE(Q5); break;
        case T_Q4_K_R8: BY_TILE(Q4K); break;
        case T_Q6_K_R8: BY_TILE(Q6K); break;
    }
}
#else
/* Without VNNI no matrix is interleaved (llorch_repacked_type), so this is never called. */
void llorch_interleaved_rows(int type, const uint8_t *w, int64_t k, int64_t j0, int64_t j1, const act_block *const *x,
                             int tile, float *out, int64_t ldo, int ahead) {
    (void)type; (void)w; (void)k; (void)j0; (void)j1; (void)x; (void)tile; (void)out; (void)ldo; (void)ahead;
}
#endif
