/* GGUF block formats: each weight row is read in the file's own layout and unpacked, 32
 * values at a time, into one form the integer dot understands (unsigned bytes v, and per
 * half-block a scale s and an offset m: weight = s * v - m). Q8_0 is the exception: its
 * values stay signed (m = 0), since v + 128 would not fit AVX2's 16-bit pair products.
 *
 * The layouts follow the GGUF format (ggml's block definitions); each unpacker is checked
 * against the gguf package's reference dequantization in tests/test_kernels.py.
 */
#include "simd.h"

int64_t llorch_row_bytes(int type, int64_t k) {
    switch (type > REPACKED ? type - REPACKED : type) {  /* an interleaved layout keeps its bytes */
        case T_F32: return 4 * k;
        case T_F16: case T_BF16: return 2 * k;
        case T_Q4_0: return k / QK * 18;
        case T_Q4_1: return k / QK * 20;
        case T_Q5_0: return k / QK * 22;
        case T_Q5_1: return k / QK * 24;
        case T_Q8_0: return k / QK * 34;
        case T_Q2_K: return k / QK_K * 84;
        case T_Q3_K: return k / QK_K * 110;
        case T_Q4_K: return k / QK_K * 144;
        case T_Q5_K: return k / QK_K * 176;
        case T_Q6_K: return k / QK_K * 210;
        default: return 0;
    }
}

static inline void set_block(const unpacked_row *u, int64_t b, float s0, float m0, float s1, float m1) {
    u->s[2 * b] = s0;
    u->s[2 * b + 1] = s1;
    u->m[2 * b] = m0;
    u->m[2 * b + 1] = m1;
}

/* -- the 32-value types ---------------------------------------------------------------------- */
static void unpack_q4_0(const uint8_t *row, int64_t k, const unpacked_row *u) {
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + b * 18;
        const float d = fp16_to_fp32(read_u16(blk));
        uint8_t *v = u->v + b * QK;
#ifdef LLORCH_AVX2
        _mm256_storeu_si256((__m256i *)v, nibbles(blk + 2));
#else
        for (int j = 0; j < 16; j++) { v[j] = blk[2 + j] & 0x0f; v[j + 16] = blk[2 + j] >> 4; }
#endif
        set_block(u, b, d, 8 * d, d, 8 * d);
    }
}

static void unpack_q4_1(const uint8_t *row, int64_t k, const unpacked_row *u) {
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + b * 20;
        const float d = fp16_to_fp32(read_u16(blk)), min = fp16_to_fp32(read_u16(blk + 2));
        uint8_t *v = u->v + b * QK;
        for (int j = 0; j < 16; j++) { v[j] = blk[4 + j] & 0x0f; v[j + 16] = blk[4 + j] >> 4; }
        set_block(u, b, d, -min, d, -min);
    }
}

static void unpack_q5_0(const uint8_t *row, int64_t k, const unpacked_row *u) {
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + b * 22;
        const float d = fp16_to_fp32(read_u16(blk));
        uint32_t high;
        memcpy(&high, blk + 2, 4);
        uint8_t *v = u->v + b * QK;
#ifdef LLORCH_AVX2
        _mm256_storeu_si256((__m256i *)v, _mm256_or_si256(nibbles(blk + 6), bits_to_bit4(high)));
#else
        for (int j = 0; j < 16; j++) {
            v[j] = (uint8_t)((blk[6 + j] & 0x0f) | (((high >> j) & 1) << 4));
            v[j + 16] = (uint8_t)((blk[6 + j] >> 4) | (((high >> (j + 16)) & 1) << 4));
        }
#endif
        set_block(u, b, d, 16 * d, d, 16 * d);
    }
}

static void unpack_q5_1(const uint8_t *row, int64_t k, const unpacked_row *u) {
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + b * 24;
        const float d = fp16_to_fp32(read_u16(blk)), min = fp16_to_fp32(read_u16(blk + 2));
        uint32_t high;
        memcpy(&high, blk + 4, 4);
        uint8_t *v = u->v + b * QK;
        for (int j = 0; j < 16; j++) {
            v[j] = (uint8_t)((blk[8 + j] & 0x0f) | (((high >> j) & 1) << 4));
            v[j + 16] = (uint8_t)((blk[8 + j] >> 4) | (((high >> (j + 16)) & 1) << 4));
        }
        set_block(u, b, d, -min, d, -min);
    }
}

static void unpack_q8_0(const uint8_t *row, int64_t k, const unpacked_row *u) {
    for (int64_t b = 0; b < k / QK; b++) {
        const uint8_t *blk = row + b * 34;
        const float d = fp16_to_fp32(read_u16(blk));
        memcpy(u->v + b * QK, blk + 2, QK);  /* signed values, kept as they are */
        set_block(u, b, d, 0.0f, d, 0.0f);
    }
}

/* The scales and minimums of sub-blocks j and j + 1 (blocks b and b + 1) of a Q4_K/Q5_K super-block. */
static inline void set_k4_blocks(const unpacked_row *u, int64_t b, int j, const uint8_t *scales, float d, float dmin) {
    for (int half = 0; half < 2; half++) {
        uint8_t sc, mn;
        k4_scale_min(j + half, scales, &sc, &mn);
        set_block(u, b + half, d * sc, dmin * mn, d * sc, dmin * mn);
    }
}

/* -- the K-quants (256-value super-blocks) ------------------------------------------------------- */

static void unpack_q4_k(const uint8_t *row, int64_t k, const unpacked_row *u) {
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *blk = row + sb * 144;
        const float d = fp16_to_fp32(read_u16(blk)), dmin = fp16_to_fp32(read_u16(blk + 2));
        const uint8_t *scales = blk + 4, *qs = blk + 16;
        for (int c = 0; c < 4; c++) {  /* 64 values: low nibbles (sub-block 2c), high nibbles (2c + 1) */
            uint8_t *v = u->v + sb * QK_K + 64 * c;
#ifdef LLORCH_AVX2
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i low = _mm256_set1_epi8(0x0f);
            _mm256_storeu_si256((__m256i *)v, _mm256_and_si256(raw, low));
            _mm256_storeu_si256((__m256i *)(v + 32), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
#else
            for (int l = 0; l < 32; l++) { v[l] = qs[32 * c + l] & 0x0f; v[l + 32] = qs[32 * c + l] >> 4; }
#endif
            set_k4_blocks(u, sb * 8 + 2 * c, 2 * c, scales, d, dmin);
        }
    }
}

static void unpack_q5_k(const uint8_t *row, int64_t k, const unpacked_row *u) {
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *blk = row + sb * 176;
        const float d = fp16_to_fp32(read_u16(blk)), dmin = fp16_to_fp32(read_u16(blk + 2));
        const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + 48;
        for (int c = 0; c < 4; c++) {
            uint8_t *v = u->v + sb * QK_K + 64 * c;
#ifdef LLORCH_AVX2
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            const __m256i high = _mm256_loadu_si256((const __m256i *)qh);
            const __m256i low = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
            /* bit 2c (then 2c + 1) of each high byte, moved to bit 4 within its byte */
            const int b0 = 2 * c, b1 = 2 * c + 1;
            const __m256i h0 = b0 <= 4 ? _mm256_slli_epi16(high, 4 - b0) : _mm256_srli_epi16(high, b0 - 4);
            const __m256i h1 = b1 <= 4 ? _mm256_slli_epi16(high, 4 - b1) : _mm256_srli_epi16(high, b1 - 4);
            _mm256_storeu_si256((__m256i *)v, _mm256_or_si256(_mm256_and_si256(raw, low), _mm256_and_si256(h0, bit4)));
            _mm256_storeu_si256((__m256i *)(v + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                                                                     _mm256_and_si256(h1, bit4)));
#else
            for (int l = 0; l < 32; l++) {
                v[l] = (uint8_t)((qs[32 * c + l] & 0x0f) | (((qh[l] >> (2 * c)) & 1) << 4));
                v[l + 32] = (uint8_t)((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
            }
#endif
            set_k4_blocks(u, sb * 8 + 2 * c, 2 * c, scales, d, dmin);
        }
    }
}

static void unpack_q6_k(const uint8_t *row, int64_t k, const unpacked_row *u) {
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *blk = row + sb * 210;
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float d = fp16_to_fp32(read_u16(blk + 208));
        for (int n = 0; n < 2; n++) {  /* 128 values: four blocks of 32 */
            const uint8_t *l0 = ql + 64 * n, *h = qh + 32 * n;
            uint8_t *v = u->v + sb * QK_K + 128 * n;
#ifdef LLORCH_AVX2
            const __m256i a = _mm256_loadu_si256((const __m256i *)l0);
            const __m256i b = _mm256_loadu_si256((const __m256i *)(l0 + 32));
            const __m256i hi = _mm256_loadu_si256((const __m256i *)h);
            const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x30);
            _mm256_storeu_si256((__m256i *)v, _mm256_or_si256(_mm256_and_si256(a, low),
                                                              _mm256_and_si256(_mm256_slli_epi16(hi, 4), two)));
            _mm256_storeu_si256((__m256i *)(v + 32), _mm256_or_si256(_mm256_and_si256(b, low),
                                                                     _mm256_and_si256(_mm256_slli_epi16(hi, 2), two)));
            _mm256_storeu_si256((__m256i *)(v + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low),
                                                                     _mm256_and_si256(hi, two)));
            _mm256_storeu_si256((__m256i *)(v + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low),
                                                                     _mm256_and_si256(_mm256_srli_epi16(hi, 2), two)));
#else
            for (int l = 0; l < 32; l++) {
                v[l] = (uint8_t)((l0[l] & 0x0f) | ((h[l] & 3) << 4));
                v[l + 32] = (uint8_t)((l0[l + 32] & 0x0f) | (((h[l] >> 2) & 3) << 4));
                v[l + 64] = (uint8_t)((l0[l] >> 4) | (((h[l] >> 4) & 3) << 4));
                v[l + 96] = (uint8_t)((l0[l + 32] >> 4) | (((h[l] >> 6) & 3) << 4));
            }
#endif
            for (int q = 0; q < 4; q++) {  /* block q of this half: sub-blocks of 16 with their own scales */
                const float s0 = d * scales[8 * n + 2 * q], s1 = d * scales[8 * n + 2 * q + 1];
                set_block(u, sb * 8 + 4 * n + q, s0, 32 * s0, s1, 32 * s1);
            }
        }
    }
}

static void unpack_q2_k(const uint8_t *row, int64_t k, const unpacked_row *u) {
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *blk = row + sb * 84;
        const uint8_t *scales = blk, *qs = blk + 16;
        const float d = fp16_to_fp32(read_u16(blk + 80)), dmin = fp16_to_fp32(read_u16(blk + 82));
        int is = 0;
        for (int n = 0; n < 2; n++) {  /* 128 values, from 32 bytes: four shifts of two bits */
            const uint8_t *q = qs + 32 * n;
            for (int shift = 0; shift < 8; shift += 2) {
                const int64_t base = sb * QK_K + 128 * n + 16 * shift;  /* 32 values */
                for (int l = 0; l < 32; l++) u->v[base + l] = (q[l] >> shift) & 3;
                const uint8_t a = scales[is++], b = scales[is++];
                set_block(u, base / QK, d * (a & 0x0f), dmin * (a >> 4), d * (b & 0x0f), dmin * (b >> 4));
            }
        }
    }
}

static void unpack_q3_k(const uint8_t *row, int64_t k, const unpacked_row *u) {
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
        const uint8_t *blk = row + sb * 110;
        const uint8_t *hmask = blk, *qs = blk + 32, *packed = blk + 96;
        const float d = fp16_to_fp32(read_u16(blk + 108));
        /* sixteen 6-bit scales, stored with an offset of 32 */
        uint32_t aux[4];
        memcpy(aux, packed, 12);
        const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f, tmp = aux[2];
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
        int8_t scale[16];
        memcpy(scale, aux, 16);
        int is = 0;
        uint8_t bit = 1;
        for (int n = 0; n < 2; n++) {
            const uint8_t *q = qs + 32 * n;
            for (int shift = 0; shift < 8; shift += 2, bit <<= 1) {
                const int64_t base = sb * QK_K + 128 * n + 16 * shift;
                /* value = 2-bit part - (4 when the high-mask bit is clear): v = value + 4 in 0..7 */
                for (int l = 0; l < 32; l++) {
                    u->v[base + l] = (uint8_t)(((q[l] >> shift) & 3) + ((hmask[l] & bit) ? 4 : 0));
                }
                const float s0 = d * (scale[is] - 32), s1 = d * (scale[is + 1] - 32);
                is += 2;
                set_block(u, base / QK, s0, 4 * s0, s1, 4 * s1);
            }
        }
    }
}

/* Unpack one row of a block type; returns 0 for a type that is not a block type. */
int llorch_unpack_row(int type, const uint8_t *row, int64_t k, const unpacked_row *u) {
    switch (type) {
        case T_Q4_0: unpack_q4_0(row, k, u); return 1;
        case T_Q4_1: unpack_q4_1(row, k, u); return 1;
        case T_Q5_0: unpack_q5_0(row, k, u); return 1;
        case T_Q5_1: unpack_q5_1(row, k, u); return 1;
        case T_Q8_0: unpack_q8_0(row, k, u); return 1;
        case T_Q2_K: unpack_q2_k(row, k, u); return 1;
        case T_Q3_K: unpack_q3_k(row, k, u); return 1;
        case T_Q4_K: unpack_q4_k(row, k, u); return 1;
        case T_Q5_K: unpack_q5_k(row, k, u); return 1;
        case T_Q6_K: unpack_q6_k(row, k, u); return 1;
        default: return 0;
    }
}

/* One row of any type these kernels read, as floats (embedding lookups, prompt-chunk fallbacks
 * and tests). */
void llorch_dequantize_row(int type, const uint8_t *row, int64_t k, float *out) {
    if (type == T_F32) { memcpy(out, row, (size_t)k * 4); return; }
    if (type == T_F16 || type == T_BF16) {
        for (int64_t i = 0; i < k; i++) {
            const uint16_t h = read_u16(row + 2 * i);
            out[i] = type == T_F16 ? fp16_to_fp32(h) : bf16_to_fp32(h);
        }
        return;
    }
    uint8_t v[QK_K];
    float s[QK_K / QK * 2], m[QK_K / QK * 2];
    const int64_t step = type == T_Q2_K || type == T_Q3_K || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K
                             ? QK_K : QK;
    const int64_t bytes = llorch_row_bytes(type, step);
    for (int64_t start = 0; start < k; start += step) {
        const unpacked_row u = {v, s, m};
        llorch_unpack_row(type, row + start / step * bytes, step, &u);
        for (int64_t i = 0; i < step; i++) {
            const int64_t half = i / 16;
            const float value = type == T_Q8_0 ? (float)(int8_t)v[i] : (float)v[i];
            out[start + i] = s[half] * value - m[half];
        }
    }
}

/* A quantized block's scale and sums (d * the whole sum, once, for the kernels). */
static inline void set_block_sums(act_block *dst, float d, int sum0, int sum1) {
    dst->d = d;
    dst->dsum = d * (float)(sum0 + sum1);
    dst->sum[0] = (int16_t)sum0;
    dst->sum[1] = (int16_t)sum1;
}

#ifndef LLORCH_AVX2
/* One block of 32 activation values -> its int8 values, scale and sums (the vector form below
 * reproduces it bit for bit: the same float operations, rounding and clamping). */
static void quantize_block(const float *src, act_block *dst) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float a = src[j] < 0 ? -src[j] : src[j];
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, inverse = amax > 0 ? 127.0f / amax : 0.0f;
    int sum0 = 0, sum1 = 0;
    for (int j = 0; j < QK; j++) {
        const float scaled = src[j] * inverse;
        int q = (int)(scaled < 0 ? scaled - 0.5f : scaled + 0.5f);
        q = q > 127 ? 127 : (q < -127 ? -127 : q);
        dst->q[j] = (int8_t)q;
        if (j < 16) sum0 += q; else sum1 += q;
    }
    set_block_sums(dst, d, sum0, sum1);
}
#else
/* Why vectors: a step quantizes every projection's input rows. Measured (one thread, Zen 4):
 * 32 rows of 5632 values 227 -> 73 us. */
static void quantize_block(const float *src, act_block *dst) {
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int c = 0; c < 4; c++) {
        v[c] = _mm256_loadu_ps(src + 8 * c);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[c]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f, inverse = amax > 0 ? 127.0f / amax : 0.0f;
    const __m256 scale = _mm256_set1_ps(inverse);
    __m256i q[4];
    for (int c = 0; c < 4; c++) {
        const __m256 scaled = _mm256_mul_ps(v[c], scale);
        const __m256 rounded = _mm256_add_ps(scaled, _mm256_or_ps(_mm256_and_ps(scaled, sign), half));
        const __m256i truncated = _mm256_cvttps_epi32(rounded);  /* after +-0.5: ties away from zero */
        q[c] = _mm256_max_epi32(_mm256_min_epi32(truncated, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    }
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)dst->q, bytes);
    const __m256i halves = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    const __m128i both = _mm_add_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
    const __m128i summed = _mm_hadd_epi32(both, both);  /* lanes: values 0-15, 16-31, ... */
    set_block_sums(dst, d, _mm_cvtsi128_si32(summed), _mm_extract_epi32(summed, 1));
}
#endif

/* Activation rows -> int8 blocks of 32 with a float scale (largest |x| maps to 127) and the
 * sums of each half's values. Rounding is to nearest, ties away from zero. */
void llorch_quantize_rows(const float *x, int64_t m, int64_t k, act_block *out) {
    const int64_t blocks = k / QK;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t b = 0; b < blocks; b++) quantize_block(x + i * k + b * QK, out + i * blocks + b);
    }
}
