/* SIMD helpers the kernels share, and the K-quant scale unpacking. */
#ifndef LLORCH_SIMD_H
#define LLORCH_SIMD_H

#include "llorch.h"

/* Sub-block j's 6-bit scale and minimum from a Q4_K/Q5_K super-block's 12 packed bytes. */
static inline void k4_scale_min(int j, const uint8_t *q, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (uint8_t)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        *min = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* a . b over n floats: one vector accumulator in order, then its reduction. */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    total = _mm512_reduce_add_ps(acc);
#elif defined(LLORCH_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    total = _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* n floats at src as float16 at dst (the KV cache's form), rounded to nearest even. */
static inline void store_fp16(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
#ifdef LLORCH_AVX2
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = fp32_to_fp16(src[i]);
}

/* Asks for the `bytes` that lie PREFETCH_AHEAD past `p`. Why: the hardware prefetchers stop
 * at each 4 KiB page, so a kernel streaming weights from memory stalls at every new page;
 * asking ahead keeps memory busy while the current bytes are computed on. Measured streaming
 * Q4_K and Q6_K from memory (2 threads, Xeon): 17.7 -> 26 GB/s, the read roofline being 29.
 * Always inlined, as prefetch_halves: a prefetch changes nothing the compiler can see, so where it
 * declined to inline one (a caller grown past its inlining limits) it deleted the call as dead, and
 * every request ahead was gone without a warning. That was the AVX2 kernels (interleaved_avx2.c)
 * in every build: with their requests back, the 1.1B file decoding 4 / 8 / 16 streams ran 1.19x /
 * 1.41x / 1.19x (two threads, Zen 5, windows in turn), one stream 1.01x. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *p, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + PREFETCH_AHEAD + line, 0, 3);
}

/* prefetch_ahead's requests for `bytes` from p, part `part` of `parts` (a block's lines split evenly): asked for
 * a part at each of a block's steps instead of all at its start. */
static inline __attribute__((always_inline)) void prefetch_part(const uint8_t *p, int64_t bytes, int part, int parts) {
    const int64_t lines = (bytes + 63) / 64, from = lines * part / parts, to = lines * (part + 1) / parts;
    for (int64_t line = from; line < to; line++) __builtin_prefetch(p + PREFETCH_AHEAD + 64 * line, 0, 3);
}

/* Asks for the cache lines of n float16 values from p (a key or value row read soon). */
static inline __attribute__((always_inline)) void prefetch_halves(const uint16_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) __builtin_prefetch(p + i, 0, 3);
}

/* A kernel's call for `tile` activation rows (1 .. most), each count a constant in its own copy, so
 * that the loops over the rows unroll; BY_TILE up to the file's TILE. */
#define BY_TILE_UP_TO(call_with_tile, most) \
    switch (tile) {                         \
        case 1: call_with_tile(1); break;   \
        case 2: call_with_tile(2); break;   \
        case 3: call_with_tile(3); break;   \
        default: call_with_tile(most); break; \
    }
#define BY_TILE(call_with_tile) BY_TILE_UP_TO(call_with_tile, TILE)

#ifdef LLORCH_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* Eight int32 lanes of unsigned bytes w times signed bytes x (lanes 0-3: values 0-15). */
static inline __m256i idot_unsigned(__m256i w, __m256i x) {
#ifdef LLORCH_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

/* The same for signed w: |w| times x with w's sign, so no pair product overflows 16 bits. */
static inline __m256i idot_signed(__m256i w, __m256i x) {
    return idot_unsigned(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

/* 16 bytes -> their low nibbles then their high nibbles, as 32 bytes. */
static inline __m256i nibbles(const uint8_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    const __m128i low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
}

/* The 32 bits of `bits` as 32 bytes: 0x10 where the bit is set (bit i -> byte i). Byte i takes
 * source byte i / 8, keeps only bit i % 8, and becomes 0xFF when it was set, then 0x10. */
static inline __m256i bits_to_bit4(uint32_t bits) {
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select), _mm256_set1_epi8(0x10));
}
#endif

/* a . b over n values, b float16: dot_f32's order, so that attention.c's sixteen-at-once path
 * gives the same bits. */
static inline float dot_f32_f16(const float *a, const uint16_t *b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + i))), acc);
    total = _mm512_reduce_add_ps(acc);
#elif defined(LLORCH_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i))), acc);
    total = hsum8(acc);
#endif
    for (; i < n; i++) total += a[i] * fp16_to_fp32(b[i]);
    return total;
}

#endif
