/* Direct dot kernels for the common block types: each 32-value block is decoded in registers
 * and multiplied with up to four activation rows at once, with no unpacked copy in between.
 *
 * Each type always takes the same path, and every row's float operations are the same
 * whatever tile or batch it is computed in: a row's result is the same bits alone or
 * batched. The symmetric types (Q8_0, Q4_0, Q5_0, Q6_K) are decoded to signed values,
 * so they need no offset term; Q4_K and Q5_K keep their per-sub-block minimums. Compiled
 * only where AVX2 is (the portable build uses the unpack path of matmul.c).
 */
#include "simd.h"

#ifdef LLORCH_AVX2

#define TILE 4 /* activation rows sharing one decoded weight block */

/* Blocks are accumulated into two vectors per row, alternating (even blocks, odd blocks), so
 * consecutive blocks do not wait on one FMA chain; the two are added once at the end. */

/* One block of a symmetric type, decoded to signed values (weight = s * v per half), into
 * the tile's accumulators for block parity `p`. */
static inline __attribute__((always_inline)) void accumulate_signed(__m256i v, float s0, float s1, int same_scale,
                                                                   const act_block *const *x, int64_t b, int tile,
                                                                   __m256 acc[][2], int p) {
    const __m256i magnitude = _mm256_sign_epi8(v, v);
    for (int t = 0; t < tile; t++) {
        const act_block *a = x[t] + b;
        const __m256i q = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a->q), v);
        const float dx = a->d;
        const __m256 scale = same_scale ? _mm256_set1_ps(s0 * dx)
                                        : _mm256_set_m128(_mm_set1_ps(s1 * dx), _mm_set1_ps(s0 * dx));
        acc[t][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot_unsigned(magnitude, q)), scale, acc[t][p]);
    }
}

/* One block of a K-quant with minimums, decoded to unsigned values (weight = s * v - m). */
static inline __attribute__((always_inline)) void accumulate_offset(__m256i v, float s, float m,
                                                                   const act_block *const *x, int64_t b, int tile,
                                                                   __m256 acc[][2], float offsets[][2], int p) {
    for (int t = 0; t < tile; t++) {
        const act_block *a = x[t] + b;
        const __m256i q = _mm256_loadu_si256((const __m256i *)a->q);
        const float dx = a->d;
        acc[t][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot_unsigned(v, q)), _mm256_set1_ps(s * dx), acc[t][p]);
        offsets[t][p] += dx * m * (float)(a->sum[0] + a->sum[1]);
    }
}

#define BEGIN_ROW()                                                                    \
    __m256 acc[TILE][2];                                                               \
    float offsets[TILE][2];                                                            \
    for (int t = 0; t < tile; t++) {                                                   \
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();                                   \
        offsets[t][0] = offsets[t][1] = 0.0f;                                          \
    }
#define END_ROW()                                                                      \
    for (int t = 0; t < tile; t++)                                                     \
        out[t] = hsum8(_mm256_add_ps(acc[t][0], acc[t][1])) - (offsets[t][0] + offsets[t][1]);

/* Each kernel: one weight row against `tile` activation rows, results into out[t]. */
/* The 32-value types: two blocks per iteration, one per accumulator (the parity is a constant). */
#define BLOCK_PAIRS(DECODE)                                                                  \
    int64_t b = 0;                                                                           \
    for (; b + 2 <= k / QK; b += 2) {                                                        \
        DECODE(b, 0)                                                                         \
        DECODE(b + 1, 1)                                                                     \
    }                                                                                        \
    if (b < k / QK) { DECODE(b, 0) }

static inline __attribute__((always_inline)) void row_q8_0(const uint8_t *row, int64_t k, const act_block *const *x,
                                                          int tile, float *out) {
    BEGIN_ROW()
#define DECODE_Q8_0(i, p)                                                                     \
    {                                                                                         \
        const uint8_t *blk = row + (i) * 34;                                                  \
        const float d = fp16_to_fp32(read_u16(blk));                                               \
        accumulate_signed(_mm256_loadu_si256((const __m256i *)(blk + 2)), d, d, 1, x, i, tile, acc, p); \
    }
    BLOCK_PAIRS(DECODE_Q8_0)
    END_ROW()
}

static inline __attribute__((always_inline)) void row_q4_0(const uint8_t *row, int64_t k, const act_block *const *x,
                                                          int tile, float *out) {
    BEGIN_ROW()
    const __m256i eight = _mm256_set1_epi8(8);
#define DECODE_Q4_0(i, p)                                                                     \
    {                                                                                         \
        const uint8_t *blk = row + (i) * 18;                                                  \
        const float d = fp16_to_fp32(read_u16(blk));                                               \
        accumulate_signed(_mm256_sub_epi8(nibbles(blk + 2), eight), d, d, 1, x, i, tile, acc, p); \
    }
    BLOCK_PAIRS(DECODE_Q4_0)
    END_ROW()
}

static inline __attribute__((always_inline)) void row_q5_0(const uint8_t *row, int64_t k, const act_block *const *x,
                                                          int tile, float *out) {
    BEGIN_ROW()
    const __m256i sixteen = _mm256_set1_epi8(16);
#define DECODE_Q5_0(i, p)                                                                     \
    {                                                                                         \
        const uint8_t *blk = row + (i) * 22;                                                  \
        const float d = fp16_to_fp32(read_u16(blk));                                               \
        uint32_t high;                                                                        \
        memcpy(&high, blk + 2, 4);                                                            \
        const __m256i v = _mm256_sub_epi8(_mm256_or_si256(nibbles(blk + 6), bits_to_bit4(high)), sixteen); \
        accumulate_signed(v, d, d, 1, x, i, tile, acc, p);                                   \
    }
    BLOCK_PAIRS(DECODE_Q5_0)
    END_ROW()
}

static inline __attribute__((always_inline)) void row_q4_k(const uint8_t *row, int64_t k, const act_block *const *x,
                                                          int tile, float *out) {
    BEGIN_ROW()
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *blk = row + sb * 144;
        const float d = fp16_to_fp32(read_u16(blk)), dmin = fp16_to_fp32(read_u16(blk + 2));
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
            uint8_t sc, mn;
            k4_scale_min(2 * c, blk + 4, &sc, &mn);
            accumulate_offset(_mm256_and_si256(raw, low), d * sc, dmin * mn, x, sb * 8 + 2 * c, tile, acc, offsets, 0);
            k4_scale_min(2 * c + 1, blk + 4, &sc, &mn);
            accumulate_offset(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), d * sc, dmin * mn, x, sb * 8 + 2 * c + 1,
                              tile, acc, offsets, 1);
        }
    }
    END_ROW()
}

static inline __attribute__((always_inline)) void row_q5_k(const uint8_t *row, int64_t k, const act_block *const *x,
                                                          int tile, float *out) {
    BEGIN_ROW()
    const __m256i low = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *blk = row + sb * 176;
        const float d = fp16_to_fp32(read_u16(blk)), dmin = fp16_to_fp32(read_u16(blk + 2));
        const __m256i high = _mm256_loadu_si256((const __m256i *)(blk + 16));
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 48 + 32 * c));
            /* bit 2c (then 2c + 1) of each high byte, moved to bit 4 within its byte */
            const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(_mm256_slli_epi16(high, 7 - 2 * c), 3), bit4);
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(_mm256_slli_epi16(high, 6 - 2 * c), 3), bit4);
            uint8_t sc, mn;
            k4_scale_min(2 * c, blk + 4, &sc, &mn);
            accumulate_offset(_mm256_or_si256(_mm256_and_si256(raw, low), h0), d * sc, dmin * mn, x, sb * 8 + 2 * c,
                              tile, acc, offsets, 0);
            k4_scale_min(2 * c + 1, blk + 4, &sc, &mn);
            accumulate_offset(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), h1), d * sc, dmin * mn,
                              x, sb * 8 + 2 * c + 1, tile, acc, offsets, 1);
        }
    }
    END_ROW()
}

static inline __attribute__((always_inline)) void row_q6_k(const uint8_t *row, int64_t k, const act_block *const *x,
                                                          int tile, float *out) {
    BEGIN_ROW()
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *blk = row + sb * 210;
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float d = fp16_to_fp32(read_u16(blk + 208));
        for (int n = 0; n < 2; n++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i bq = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            const __m256i v[4] = {
                _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(hi, 4), two)),
                _mm256_or_si256(_mm256_and_si256(bq, low), _mm256_and_si256(_mm256_slli_epi16(hi, 2), two)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(hi, two)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bq, 4), low),
                                _mm256_and_si256(_mm256_srli_epi16(hi, 2), two)),
            };
            for (int q = 0; q < 4; q++) {
                const float s0 = d * scales[8 * n + 2 * q], s1 = d * scales[8 * n + 2 * q + 1];
                accumulate_signed(_mm256_sub_epi8(v[q], bias), s0, s1, 0, x, sb * 8 + 4 * n + q, tile, acc, q & 1);
            }
        }
    }
    END_ROW()
}

/* Rows [j0, j1) of the weight matrix against `tile` activation rows, into out[t * ldo + j]. */
#define ROWS_OF(fn)                                                                          \
    static void rows_##fn(const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1, int64_t k, \
                          const act_block *const *x, int tile, float *out, int64_t ldo, int ahead) { \
        float results[TILE];                                                                 \
        for (int64_t j = j0; j < j1; j++) {                                                  \
            if (ahead) prefetch_ahead(w + j * row_bytes, row_bytes);                         \
            switch (tile) {                                                                  \
                case 1: fn(w + j * row_bytes, k, x, 1, results); break;                     \
                case 2: fn(w + j * row_bytes, k, x, 2, results); break;                     \
                case 3: fn(w + j * row_bytes, k, x, 3, results); break;                     \
                default: fn(w + j * row_bytes, k, x, TILE, results); break;                 \
            }                                                                                \
            for (int t = 0; t < tile; t++) out[t * ldo + j] = results[t];                    \
        }                                                                                    \
    }
ROWS_OF(row_q8_0)
ROWS_OF(row_q4_0)
ROWS_OF(row_q5_0)
ROWS_OF(row_q4_k)
ROWS_OF(row_q5_k)
ROWS_OF(row_q6_k)

int llorch_direct_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1, int64_t k,
                       const act_block *const *x, int tile, float *out, int64_t ldo, int ahead) {
    switch (type) {
        case T_Q8_0: rows_row_q8_0(w, row_bytes, j0, j1, k, x, tile, out, ldo, ahead); return 1;
        case T_Q4_0: rows_row_q4_0(w, row_bytes, j0, j1, k, x, tile, out, ldo, ahead); return 1;
        case T_Q5_0: rows_row_q5_0(w, row_bytes, j0, j1, k, x, tile, out, ldo, ahead); return 1;
        case T_Q4_K: rows_row_q4_k(w, row_bytes, j0, j1, k, x, tile, out, ldo, ahead); return 1;
        case T_Q5_K: rows_row_q5_k(w, row_bytes, j0, j1, k, x, tile, out, ldo, ahead); return 1;
        case T_Q6_K: rows_row_q6_k(w, row_bytes, j0, j1, k, x, tile, out, ldo, ahead); return 1;
        default: return 0;
    }
}

int llorch_has_direct(int type) {
    return type == T_Q8_0 || type == T_Q4_0 || type == T_Q5_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

#else /* no AVX2: every type goes through the unpack path */

int llorch_direct_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1, int64_t k,
                       const act_block *const *x, int tile, float *out, int64_t ldo, int ahead) {
    (void)type; (void)w; (void)row_bytes; (void)j0; (void)j1; (void)k; (void)x; (void)tile; (void)out; (void)ldo;
    (void)ahead;
    return 0;
}

int llorch_has_direct(int type) {
    (void)type;
    return 0;
}

#endif
