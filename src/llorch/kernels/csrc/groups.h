/* Reading the interleaved layouts (repack.c) two groups of eight rows at a time, into 512-bit
 * registers: lanes 0-7 (bytes 0-31 of a step) the first group's rows, 8-15 the second's. Shared by
 * the 8-bit dot kernels (interleaved.c) and the AMX kernels (amx.c), which must read the same
 * values to give the same bits. */
#ifndef LLORCH_GROUPS_H
#define LLORCH_GROUPS_H

#include "simd.h"

#ifdef LLORCH_VNNI
/* Sixteen bytes: eight at a, then eight at b. */
static inline __m128i two_halves(const uint8_t *a, const uint8_t *b) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
}

/* 32 bytes at a in the low half, 32 at b in the high half. */
static inline __m512i two_steps(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* The eight float16 scales at a, then the eight at b, as floats. */
static inline __m512 two_scales(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)b), _mm_loadu_si128((const __m128i *)a)));
}

/* A Q5_0_R8 block of both groups (ga, gb): its eight steps as unsigned values 0..31. */
static inline void q5_0_steps(const uint8_t *ga, const uint8_t *gb, __m512i v[8]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; c++) {
        const __m512i packed = two_steps(ga + 16 + 32 * c, gb + 16 + 32 * c);
        v[c] = _mm512_and_si512(packed, low);
        v[c + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
    const __m512i fifths = two_steps(ga + 144, gb + 144); /* step c's fifth bits at bit c of its bytes */
    for (int c = 0; c < 8; c++)
        v[c] = _mm512_mask_add_epi8(v[c], _mm512_test_epi8_mask(fifths, _mm512_set1_epi8((char)(1 << c))), v[c],
                                    _mm512_set1_epi8(16));
}

/* A Q4_K_R8 super-block's 6-bit sub-block scales and minimums, both groups: [0] scales 0-3, [1]
 * scales 4-7, [2] minimums 0-3, [3] minimums 4-7, each [sub-block][group][row] (16 bytes a sub-block:
 * the first group's eight rows, then the second's), the order q4_k_sub reads them in. */
static inline void q4_k_scales(const uint8_t *ga, const uint8_t *gb, uint8_t unpacked[4][64]) {
    const __m512i a = two_steps(ga + 32, gb + 32), b = two_steps(ga + 64, gb + 64), c = two_steps(ga + 96, gb + 96);
    const __m512i six = _mm512_set1_epi8(63), top = _mm512_set1_epi8(0x30), low = _mm512_set1_epi8(0x0f);
    /* the planes' order is [group][sub-block][row]: each sub-block's two groups brought side by side */
    const __m512i order = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
    const __m512i planes[4] = {
        _mm512_and_si512(a, six),
        _mm512_or_si512(_mm512_and_si512(c, low), _mm512_and_si512(_mm512_srli_epi16(a, 2), top)),
        _mm512_and_si512(b, six),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(c, 4), low), _mm512_and_si512(_mm512_srli_epi16(b, 2), top)),
    };
    for (int i = 0; i < 4; i++) _mm512_storeu_si512(unpacked[i], _mm512_permutexvar_epi64(order, planes[i]));
}

/* Sub-block `sub`'s scale (or, from unpacked[2..3], minimum) for the sixteen rows, as floats: one
 * load of its sixteen bytes. Why that order: gathering each sub-block's two halves from the groups'
 * own order cost three operations more per sub-block, sixteen sub-blocks a super-block. Measured
 * (Q4_K 5632 x 2048 in cache, one thread, Zen 4, alternating in one process, same bits): one
 * activation row 42.4 -> 43.8 GB/s, four rows 20.1 -> 20.6. */
static inline __m512 q4_k_sub(uint8_t unpacked[4][64], int first_plane, int sub) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(unpacked[first_plane + sub / 4] + 16 * (sub % 4)));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}

/* Q6_K_R8: the 2-bit high parts of step p (0-3) from their plane, placed at bits 4-5. */
static inline __m512i high_pair512(__m512i plane, int p) {
    const __m512i placed = p == 0 ? _mm512_slli_epi16(plane, 4)
                         : p == 1 ? _mm512_slli_epi16(plane, 2)
                         : p == 2 ? plane
                                  : _mm512_srli_epi16(plane, 2);
    return _mm512_and_si512(placed, _mm512_set1_epi8(0x30));
}
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SUB 8 /* blocks of 32 values per unpacked span: a K-quant super-block */

/* One span's weights in tile form (the int8 tile's B layout), and the float scales its sub-blocks are
 * multiplied by: what the AMX kernels read (amx.c, amx_bf16.c). */
typedef struct {
    int8_t b[SUB][8][64] __attribute__((aligned(64))); /* [block][step][weight row x 4 values] */
    __m512 scale[SUB], min[SUB];                        /* Q4_K sub-blocks; Q8_0 / Q5_0: scale = d */
    __m512 iscale[SUB][2];                              /* Q6_K: each half's 8-bit scale (as a float) */
    __m512 d, dmin;
    int blocks;                                         /* blocks of 32 in this span (<= SUB) */
} span;

/* Span s (256 values) of groups group_a and group_b of the interleaved matrix at w (`groups` groups of
 * k values) into tile form (amx.c): signed values, the layout's offset taken out. */
void llorch_amx_unpack_span(int type, const uint8_t *w, int64_t groups, int64_t k, int64_t group_a, int64_t group_b,
                            int64_t s, span *out);
#endif
#endif

#endif
