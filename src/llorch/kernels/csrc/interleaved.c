/* Kernels for the interleaved layouts of repack.c, VNNI variants (AVX2 alone: interleaved_avx2.c).
 *
 * Why: a row-at-a-time kernel adds up each block's eight lanes and scales every (activation
 * row, weight row) pair on its own; here the eight lanes are eight weight rows, so a block
 * costs eight dot instructions per activation row and its scaling is shared by the eight
 * rows. Measured on Q8_0 (one thread, Zen 4): 16 activation rows 0.43 ns per block and row
 * against 0.84 row at a time; one row 1.74 against 1.9.
 *
 * Two groups of eight rows (any two: matmul.c says which) run side by side in 512-bit registers,
 * lanes 0-7 the first group's rows and 8-15 the second's; a group left over runs as both halves,
 * its eight lanes stored.
 * Why 512 bits: once a few activation rows share the weights, the dot instructions bound the
 * kernel, and one 512-bit instruction does the work of two 256-bit ones in about the time of
 * one. Measured against the 256-bit kernels before them (Xeon, one thread, 2048 x 2048 in
 * cache, four activation rows): Q4_K 0.35 -> 0.26 ns per block and row, Q6_K 0.42 -> 0.34,
 * Q8_0 0.34 -> 0.28, Q5_0 0.37 -> 0.29.
 *
 * Every output is each block's (or sub-block's) exact integer dot, then float multiply-adds
 * in one fixed order per activation row, so a row's result does not depend on its batch, nor
 * on whether its group ran alone or beside another.
 */
#include "groups.h"

#ifdef LLORCH_VNNI
/* Activation rows a call takes against the weights it reads. Why eight, not four: the weights' unpacking
 * and their scales' (and the call's) are shared by twice the rows, and the dots of each step are twice as
 * many between loads. Measured decoding (two threads, Zen 5, windows in turn, same bits): 8 / 16 / 32
 * streams, the 1.1B file 1.15x / 1.12x / 1.11x, the default model 1.10x / 1.09x / 1.12x; one and four
 * streams level. In cache (5632 x 2048, 8 to 32 rows): Q4_K 1.15-1.18x, Q6_K 1.17-1.20x, Q8_0 1.26-1.28x. */
#define TILE INTERLEAVED_TILE
#define ROWS 8

/* A kernel's call for `tile` activation rows: TILE, or up to four (the rows left after the last TILE). */
#define BY_ROWS(call_with_tile)                           \
    if (tile == TILE) {                                   \
        call_with_tile(TILE);                             \
    } else {                                              \
        BY_TILE_UP_TO(call_with_tile, 4);                 \
    }

/* Four activation bytes read as one 32-bit value (an act_block's q is int8_t). */
typedef int32_t __attribute__((may_alias)) four_bytes;

/* acc + the dots of w's unsigned bytes with the four signed bytes at `four`, broadcast to every
 * lane. Written so that the broadcast is the dot instruction's own memory operand ({1to16}):
 * the compiler emitted a separate broadcast before every dot. Same instruction, same bits.
 * Measured on Q4_K 5632 x 2048 in cache (two threads, Zen 4): 4 activation rows 30.3 -> 34.8
 * GB/s of weights, 16 rows 8.3 -> 9.5, 32 rows 3.1 -> 3.5. */
static inline __m512i dot_broadcast(__m512i acc, __m512i w, const int8_t *four) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const four_bytes *)four));
    return acc;
}

/* Where a product goes on from the segments before (carry), each output's value so far, in store_pair's
 * lanes (a group that ran alone: its eight values in both halves); else zeros. */
static inline __m512 start_pair(const float *out_a, const float *out_b, int carry) {
    if (!carry) return _mm512_setzero_ps();
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(out_a)), _mm256_loadu_ps(out_b), 1);
}

/* Lanes 0-7 are group a's rows, 8-15 group b's (not stored when a group ran alone, as both halves). */
static inline void store_pair(float *out_a, float *out_b, __m512 v) {
    _mm256_storeu_ps(out_a, _mm512_castps512_ps256(v));
    if (out_b != out_a) _mm256_storeu_ps(out_b, _mm512_extractf32x8_ps(v, 1));
}

/* Q8_0_R8 and Q5_0_R8, the groups at wa and wb (per 32-value block): steps v[0..8) of unsigned
 * values w + offset, the offset taken back out in integers (each block's dot starts at -offset
 * times its activation sum), so every block's dot is exact and scaled once. Why: subtracting it
 * in float cost one multiply-add per block and row beside the eight dots, and took the difference
 * of two large sums. Measured on the default model's vocabulary projection (Q8_0 262144 x 640, two
 * threads, Zen 4):
 * 16 / 32 activation rows 162 -> 185 / 171 -> 184 GMAC/s, one row 31 -> 33. */
static inline __attribute__((always_inline)) void small_blocks_pair(int type, int64_t blocks, int64_t group_bytes,
                                                                  int32_t offset, const uint8_t *wa, const uint8_t *wb,
                                                                  const act_block *const *x, int tile, float *out_a,
                                                                  float *out_b, int64_t ldo, int carry, int ahead) {
    __m512 acc[TILE];
    for (int t = 0; t < tile; t++) acc[t] = start_pair(out_a + t * ldo, out_b + t * ldo, carry);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *ga = wa + b * group_bytes, *gb = wb + b * group_bytes;
        if (ahead) {
            prefetch_ahead(ga, group_bytes);
            prefetch_ahead(gb, group_bytes);
        }
        const __m512 d = two_scales(ga, gb);
        __m512i v[8];
        if (type == T_Q8_0_R8) {
            for (int c = 0; c < 8; c++) v[c] = two_steps(ga + 16 + 32 * c, gb + 16 + 32 * c);
        } else {
            q5_0_steps(ga, gb, v);
        }
        for (int t = 0; t < tile; t++) {
            const act_block *a = x[t] + b;
            __m512i even = _mm512_set1_epi32(-offset * (a->sum[0] + a->sum[1])), odd = _mm512_setzero_si512();
            for (int c = 0; c < 8; c += 2) {
                even = dot_broadcast(even, v[c], a->q + 4 * c);
                odd = dot_broadcast(odd, v[c + 1], a->q + 4 * (c + 1));
            }
            const __m512i lanes = _mm512_add_epi32(even, odd);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_mul_ps(d, _mm512_set1_ps(a->d)), acc[t]);
        }
    }
    for (int t = 0; t < tile; t++) store_pair(out_a + t * ldo, out_b + t * ldo, acc[t]);
}

/* Q4_K_R8, the groups at wa and wb (per super-block of 256):
 * d * sum_j dx_j * scale_j * dot_j - dmin * sum_j dx_j * min_j * xsum_j.
 * The high nibbles are dotted in place (byte & 0xf0, sixteen times the value: one operation fewer per
 * step than a shift and a mask) and their sub-block's scale divided by 16. The integer dot stays exact
 * (under 2^24) and a division by 16 is exact, so every product is the same real number: the same bits
 * (unless the scale times dx falls below the normal floats, some 1e-38). Measured on one row (Q4_K
 * 5632 x 2048 in cache, Zen 4, alternating in one process): one thread 40.1 -> 42.8 GB/s, two 42.8 ->
 * 45.5; four and sixteen rows unchanged. */
static inline __attribute__((always_inline)) void q4_k_pair(int64_t supers, int64_t group_bytes, const uint8_t *wa,
                                                          const uint8_t *wb, const act_block *const *x, int tile,
                                                          float *out_a, float *out_b, int64_t ldo, int carry,
                                                          int ahead) {
    __m512 total[TILE];
    for (int t = 0; t < tile; t++) total[t] = start_pair(out_a + t * ldo, out_b + t * ldo, carry);
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *ga = wa + s * group_bytes, *gb = wb + s * group_bytes;
        const __m512i low = _mm512_set1_epi8(0x0f);
        /* The steps below ask for bytes 128-1151 of each group's span, PREFETCH_AHEAD on; these ask for its
         * first 128, so that every line is asked for. Why: left out, two lines in 18 were left to the
         * hardware prefetchers, which fall behind while memory is fast. Measured decoding the 1.1B file
         * (two threads, Zen 5, the builds in turn, each window held to a read probe at 58-75 GB/s): 1.018x
         * and 1.011x (0.948 -> 0.965 and 0.941 -> 0.953 of the probe). Asking for the whole super-block at
         * its start instead: 0.994x. */
        if (ahead) {
            prefetch_ahead(ga, 128);
            prefetch_ahead(gb, 128);
        }
        uint8_t unpacked[4][64];
        q4_k_scales(ga, gb, unpacked);
        __m512 acc[TILE], mins[TILE];
        for (int t = 0; t < tile; t++) acc[t] = mins[t] = _mm512_setzero_ps();
        for (int p = 0; p < 4; p++) {
            __m512i even[TILE], odd[TILE];
            for (int t = 0; t < tile; t++) even[t] = odd[t] = _mm512_setzero_si512();
            for (int step = 0; step < 8; step++) {
                const int64_t at = 128 + (8 * p + step) * 32;
                if (ahead && step % 2 == 0) {
                    prefetch_ahead(ga + at, 64);
                    prefetch_ahead(gb + at, 64);
                }
                const __m512i packed = two_steps(ga + at, gb + at);
                const __m512i lo = _mm512_and_si512(packed, low), hi = _mm512_andnot_si512(low, packed);
                for (int t = 0; t < tile; t++) {
                    const act_block *first = x[t] + s * 8 + 2 * p;
                    even[t] = dot_broadcast(even[t], lo, first->q + 4 * step);
                    odd[t] = dot_broadcast(odd[t], hi, (first + 1)->q + 4 * step);
                }
            }
            __m512 scale[2];  /* sub-blocks 2p and 2p + 1, converted here: fewer registers held */
            for (int j = 0; j < 2; j++) scale[j] = q4_k_sub(unpacked, 0, 2 * p + j);
            scale[1] = _mm512_mul_ps(scale[1], _mm512_set1_ps(1.0f / 16));  /* odd's dots are 16 times theirs */
            for (int t = 0; t < tile; t++) {
                const act_block *first = x[t] + s * 8 + 2 * p, *second = first + 1;
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even[t]),
                                         _mm512_mul_ps(scale[0], _mm512_set1_ps(first->d)), acc[t]);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd[t]),
                                         _mm512_mul_ps(scale[1], _mm512_set1_ps(second->d)), acc[t]);
            }
        }
        /* The minimums' sums apart from the dots, in the same order: eight rows' integer sums, float sums
         * and minimums did not fit in the registers together (they spilled: 0.94x). */
        for (int p = 0; p < 4; p++) {
            const __m512 min0 = q4_k_sub(unpacked, 2, 2 * p), min1 = q4_k_sub(unpacked, 2, 2 * p + 1);
            for (int t = 0; t < tile; t++) {
                const act_block *first = x[t] + s * 8 + 2 * p, *second = first + 1;
                mins[t] = _mm512_fmadd_ps(min0, _mm512_set1_ps(first->dsum), mins[t]);
                mins[t] = _mm512_fmadd_ps(min1, _mm512_set1_ps(second->dsum), mins[t]);
            }
        }
        const __m512 d = two_scales(ga, gb), dmin = two_scales(ga + 16, gb + 16);
        for (int t = 0; t < tile; t++) total[t] = _mm512_fnmadd_ps(dmin, mins[t], _mm512_fmadd_ps(d, acc[t], total[t]));
    }
    for (int t = 0; t < tile; t++) store_pair(out_a + t * ldo, out_b + t * ldo, total[t]);
}

/* Q6_K_R8, the groups at wa and wb: per 16 values an 8-bit scale. Each half's integer dot times its
 * scale, and the two summed, are exact in float (at most 16 x 32 x 127 x 128 < 2^23 each, their sum
 * < 2^24), so multiplying in float gives the bits of the integer sum's conversion. Why float: the
 * 32-bit integer multiply is two micro-ops, on the port the conversions need too. Measured against
 * the integer form (Xeon, two threads, best of 7): products of 512 rows, 2048 x 2048 199 -> 215 GMAC/s,
 * 2048 x 5632 188 -> 199. */
static inline __attribute__((always_inline)) void q6_k_pair(int64_t supers, int64_t group_bytes, const uint8_t *wa,
                                                          const uint8_t *wb, const act_block *const *x, int tile,
                                                          float *out_a, float *out_b, int64_t ldo, int carry,
                                                          int ahead) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 total[TILE];
    for (int t = 0; t < tile; t++) total[t] = start_pair(out_a + t * ldo, out_b + t * ldo, carry);
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *ga = wa + s * group_bytes, *gb = wb + s * group_bytes;
        if (ahead) {  /* bytes 0-143 of each span ahead; the blocks' below ask for the rest (q4_k_pair says why) */
            prefetch_ahead(ga, 144);
            prefetch_ahead(gb, 144);
        }
        __m512 acc[TILE];
        for (int t = 0; t < tile; t++) acc[t] = _mm512_setzero_ps();
        for (int b = 0; b < 8; b++) {
            const uint8_t *pa = ga + 144 + b * 192, *pb = gb + 144 + b * 192;
            if (ahead) {
                prefetch_ahead(pa, 192);
                prefetch_ahead(pb, 192);
            }
            const uint8_t *sa = ga + 16 + 16 * b, *sb = gb + 16 + 16 * b;
            const __m512 scale0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(two_halves(sa, sb)));
            const __m512 scale1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(two_halves(sa + 8, sb + 8)));
            const __m512i high0 = two_steps(pa + 128, pb + 128), high1 = two_steps(pa + 160, pb + 160);
            __m512i v[8];
            for (int p = 0; p < 4; p++) {
                const __m512i bits = two_steps(pa + 32 * p, pb + 32 * p);
                v[p] = _mm512_or_si512(_mm512_and_si512(bits, low), high_pair512(high0, p));
                v[p + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bits, 4), low), high_pair512(high1, p));
            }
            for (int t = 0; t < tile; t++) {
                const act_block *a = x[t] + s * 8 + b;
                __m512i first = _mm512_set1_epi32(-32 * a->sum[0]), second = _mm512_set1_epi32(-32 * a->sum[1]);
                for (int c = 0; c < 8; c++) {
                    if (c < 4) first = dot_broadcast(first, v[c], a->q + 4 * c);
                    else second = dot_broadcast(second, v[c], a->q + 4 * c);
                }
                const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second), scale1,
                                                    _mm512_mul_ps(_mm512_cvtepi32_ps(first), scale0));
                acc[t] = _mm512_fmadd_ps(both, _mm512_set1_ps(a->d), acc[t]);
            }
        }
        const __m512 d = two_scales(ga, gb);
        for (int t = 0; t < tile; t++) total[t] = _mm512_fmadd_ps(d, acc[t], total[t]);
    }
    for (int t = 0; t < tile; t++) store_pair(out_a + t * ldo, out_b + t * ldo, total[t]);
}

static inline __attribute__((always_inline)) void small_blocks(int type, const uint8_t *w, int64_t k, int64_t ga,
                                                             int64_t gb, const act_block *const *x, int tile,
                                                             float *out, int64_t ldo, int carry, int ahead) {
    const int64_t blocks = k / QK, group_bytes = llorch_group_bytes(type), span = blocks * group_bytes;
    const int32_t offset = type == T_Q8_0_R8 ? 128 : 16;
    small_blocks_pair(type, blocks, group_bytes, offset, w + ga * span, w + gb * span, x, tile, out + ROWS * ga,
                      out + ROWS * gb, ldo, carry, ahead);
}

/* The K types (Q4_K_R8 and Q6_K_R8), per super-block of 256 values. */
static inline __attribute__((always_inline)) void k_blocks(int type, const uint8_t *w, int64_t k, int64_t ga,
                                                         int64_t gb, const act_block *const *x, int tile, float *out,
                                                         int64_t ldo, int carry, int ahead) {
    const int64_t supers = k / QK_K, group_bytes = llorch_group_bytes(type), span = supers * group_bytes;
    if (type == T_Q4_K_R8) {
        q4_k_pair(supers, group_bytes, w + ga * span, w + gb * span, x, tile, out + ROWS * ga, out + ROWS * gb, ldo,
                  carry, ahead);
    } else {
        q6_k_pair(supers, group_bytes, w + ga * span, w + gb * span, x, tile, out + ROWS * ga, out + ROWS * gb, ldo,
                  carry, ahead);
    }
}

void llorch_interleaved_groups(int type, const uint8_t *w, int64_t k, int64_t ga, int64_t gb,
                               const act_block *const *x, int tile, float *out, int64_t ldo, int carry, int ahead) {
#define Q8(n) small_blocks(T_Q8_0_R8, w, k, ga, gb, x, n, out, ldo, carry, ahead)
#define Q5(n) small_blocks(T_Q5_0_R8, w, k, ga, gb, x, n, out, ldo, carry, ahead)
#define Q4K(n) k_blocks(T_Q4_K_R8, w, k, ga, gb, x, n, out, ldo, carry, ahead)
#define Q6K(n) k_blocks(T_Q6_K_R8, w, k, ga, gb, x, n, out, ldo, carry, ahead)
    switch (type) {
        case T_Q8_0_R8: BY_ROWS(Q8); break;
        case T_Q5_0_R8: BY_ROWS(Q5); break;
        case T_Q4_K_R8: BY_ROWS(Q4K); break;
        case T_Q6_K_R8: BY_ROWS(Q6K); break;
    }
}
#elif !defined(LLORCH_AVX2) /* AVX2 without VNNI: interleaved_avx2.c */
/* Without AVX2 no matrix is interleaved (llorch_repacked_type), so this is never called. */
void llorch_interleaved_groups(int type, const uint8_t *w, int64_t k, int64_t ga, int64_t gb,
                               const act_block *const *x, int tile, float *out, int64_t ldo, int carry, int ahead) {
    (void)type; (void)w; (void)k; (void)ga; (void)gb; (void)x; (void)tile; (void)out; (void)ldo; (void)carry;
    (void)ahead;
}
#endif
