/* Kernels for the interleaved layouts of repack.c where the CPU has AVX2 but not VNNI (the avx2
 * and avx512 variants): CPUs with AVX2 alone, such as Zen 3, and AVX-512 ones without VNNI.
 *
 * Why: without the interleaved layouts these variants took the row-at-a-time kernels (direct.c),
 * which sum each block's lanes and scale every (activation row, weight row) pair apart. Here, as
 * in interleaved.c, the eight lanes of a register are eight weight rows, so a block's scaling
 * serves eight rows and nothing is summed across lanes. Measured against direct.c (Xeon, two
 * threads, the avx2 variant, each beside llama.cpp built for AVX2 alone in the same run): prefill
 * of 512 tokens, the 1.1B file 38.9 -> 79.7 tok/s (llama.cpp 86.7, 82.4), the default model 269 ->
 * 330 (433, 396); decode 16.5 -> 22.6 (19.5, 19.3) and 50.1 -> 58.4 (40.7, 37.7).
 *
 * The 8-bit dot is AVX2's pair product (vpmaddubsw: unsigned weights times signed activations,
 * two products summed to 16 bits), widened to 32 bits (vpmaddwd by ones) once per as many steps
 * as cannot overflow 16 bits: Q4_K (weights 0-15) every 8 steps, Q5_0 (0-31) every 4, Q6_K
 * (0-63) every 2. Q8_0's weights take their sign off onto the activations (|w| <= 128), one
 * step at a time. Every block's (or Q6_K half-block's) integer dot is exact, and the float
 * operations after it are interleaved.c's, in its order: a row gets the same bits as from the
 * VNNI kernels, whatever its batch.
 *
 * One or two activation rows (decoding) take a chunk's two groups in one pass, as the 512-bit
 * kernels do in their two register halves: two runs of weights are read side by side and each
 * activation broadcast serves both. More rows fill the registers with their own sums, and take
 * the groups one after the other; from INTERLEAVED_WIDE_ROWS rows on, each group's weights are
 * unpacked once for all of them (llorch_interleaved_wide, below).
 *
 * What bounds one decoding row is the vector pipes, not memory, where two cores read memory fast.
 * Q4_K's two groups take about 150 vector operations per 512 weight bytes: per 32 bytes and group, three
 * to split the nibbles, two pair products and two 16-bit sums; per sub-block, the widening, conversions
 * and multiply-adds that give the VNNI kernels' bits. Zen 5 issues two vpmaddubsw, two shifts or two FMAs
 * a cycle, four ands or adds; the kernel takes about 52 cycles per 512 bytes. In cache (5632 x 2048, the
 * two variants in turn in one process) that is 37 GB/s on one thread and 65-67 on two (Q6_K 58), against
 * 100-104 for the VNNI kernels; with memory at 70-75 GB/s, one row decodes at about 53 GB/s. Reading the
 * activations as plain aligned loads instead of broadcasts was no faster (0.99x): broadcasts cost no pipe.
 */
#include "simd.h"

#if defined(LLORCH_AVX2) && !defined(LLORCH_VNNI)
#define TILE 4
#define ROWS 8

/* Four activation bytes, in every 32-bit lane. */
static inline __m256i four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* 16-bit sums of pair products, widened: each lane (a weight row) the sum of its four products. */
static inline __m256i widen(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

/* The eight float16 scales at g, as floats. */
static inline __m256 scales8(const uint8_t *g) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g)); }

static inline __m256i step_at(const uint8_t *g) { return _mm256_loadu_si256((const __m256i *)g); }

/* Q5_0_R8: step c's fifth bits (bit c of each byte of `fifths`) as 16 in its bytes. A 16-bit shift moves bit c
 * of both bytes to their bit 4; the mask drops what crossed from the neighbouring byte. */
static inline __m256i fifth_of(__m256i fifths, int c) {
    const __m256i placed = c <= 4 ? _mm256_slli_epi16(fifths, 4 - c) : _mm256_srli_epi16(fifths, c - 4);
    return _mm256_and_si256(placed, _mm256_set1_epi8(0x10));
}

/* The sums sums[n][t] held in registers from one step to the next: an empty asm that takes each. Left to
 * itself the compiler unrolled a block's steps, summed their products as a tree and kept the products (or a
 * sum) in memory, each step waiting on a store: in every tile but the one it was first written for (one
 * group of four rows), decoding's one or two rows in two groups included. Measured where it applies below. */
static inline __attribute__((always_inline)) void hold(__m256i sums[2][TILE], int groups, int tile) {
    for (int n = 0; n < groups; n++)
        for (int t = 0; t < tile; t++) __asm__("" : "+x"(sums[n][t]));
}

/* The float sums of `groups` groups (1 or 2) and `tile` activation rows: set to zero; stored, group n's
 * row t at out[n] + t * ldo. */
static inline __attribute__((always_inline)) void zero_sums(__m256 sums[2][TILE], int groups, int tile) {
    for (int n = 0; n < groups; n++)
        for (int t = 0; t < tile; t++) sums[n][t] = _mm256_setzero_ps();
}

/* The sums where a product goes on from the segments before (carry): each output's value so far; else zeros. */
static inline __attribute__((always_inline)) void start_sums(__m256 sums[2][TILE], float *const out[2], int64_t ldo,
                                                           int groups, int tile, int carry) {
    for (int n = 0; n < groups; n++)
        for (int t = 0; t < tile; t++) sums[n][t] = carry ? _mm256_loadu_ps(out[n] + t * ldo) : _mm256_setzero_ps();
}

static inline __attribute__((always_inline)) void store_sums(float *const out[2], int64_t ldo, __m256 sums[2][TILE],
                                                           int groups, int tile) {
    for (int n = 0; n < groups; n++)
        for (int t = 0; t < tile; t++) _mm256_storeu_ps(out[n] + t * ldo, sums[n][t]);
}

/* Q8_0_R8 / Q5_0_R8, `groups` (1 or 2) groups at once, as q4_k_groups takes them (per 32-value block):
 * out = sum_b dx_b * d_b * dot_b. Decoding the default model, whose output projection is Q8_0 and most
 * of its layers Q5_0 (Xeon, two threads, after a 512-token prompt): 78.9 -> 94.9 tok/s; its prefill
 * lost 2% (834 -> 817 tok/s), Q5_0's products of 512 rows 115 -> 110 GMAC/s, though a single group
 * runs the same code as before. */
static inline __attribute__((always_inline)) void small_blocks_groups(int type, int64_t blocks, int64_t group_bytes,
                                                                    int groups, const uint8_t *ga, const uint8_t *gb,
                                                                    const act_block *const *x, int tile,
                                                                    float *out_a, float *out_b, int64_t ldo,
                                                                    int carry, int ahead) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const uint8_t *const g0[2] = {ga, gb};
    float *const out[2] = {out_a, out_b};
    __m256 acc[2][TILE];
    start_sums(acc, out, ldo, groups, tile, carry);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *g[2] = {g0[0] + b * group_bytes, g0[1] + b * group_bytes};
        for (int n = 0; n < groups && ahead; n++) prefetch_ahead(g[n], group_bytes);
        __m256i lanes[2][TILE];
        /* Q8_0: signed values, stored + 128: |w| <= 128, its sign moved onto x. Step by step for the whole
         * tile, each step's |w| made once: products of 512 rows 2048 x 2048, 75-82 -> 86-91 GMAC/s. */
        if (type == T_Q8_0_R8) {
            for (int n = 0; n < groups; n++)
                for (int t = 0; t < tile; t++) lanes[n][t] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                __m256i w[2], magnitude[2];
                for (int n = 0; n < groups; n++) {
                    w[n] = _mm256_xor_si256(step_at(g[n] + 16 + 32 * c), _mm256_set1_epi8(-128));
                    magnitude[n] = _mm256_abs_epi8(w[n]);
                }
                for (int t = 0; t < tile; t++) {
                    const __m256i a = four_bytes(x[t][b].q + 4 * c);
                    for (int n = 0; n < groups; n++) {
                        const __m256i pairs = _mm256_maddubs_epi16(magnitude[n], _mm256_sign_epi8(a, w[n]));
                        lanes[n][t] = _mm256_add_epi32(lanes[n][t], widen(pairs));
                    }
                }
                /* the sums held in registers, as in q4_k_groups: products of 64 and 512 rows (2048 x 2048, Xeon)
                 * 118 -> 126, 112 -> 126 GMAC/s; of every tile (one thread, Zen 4, in cache, alternating in one
                 * process): one row 46.0 -> 47.4 GB/s, two 27.6 -> 29.1 */
                hold(lanes, groups, tile);
            }
        } else if (groups == 1) { /* Q5_0: the low four bits in nibbles (steps 0-3 low, 4-7 high), the fifth in a
                                   * bit plane (repack.c); one group's eight steps made once for the whole tile */
            __m256i v[8];
            for (int c = 0; c < 4; c++) {
                const __m256i packed = step_at(g[0] + 16 + 32 * c);
                v[c] = _mm256_and_si256(packed, low);
                v[c + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            }
            const __m256i fifths = step_at(g[0] + 144);
            for (int c = 0; c < 8; c++) v[c] = _mm256_or_si256(v[c], fifth_of(fifths, c));
            for (int t = 0; t < tile; t++) {
                const act_block *a = x[t] + b;
                __m256i sum = _mm256_set1_epi32(-16 * (a->sum[0] + a->sum[1]));
                for (int c = 0; c < 8; c += 4) { /* 16-bit sums of four steps: at most 4 x 2 x 31 x 127 */
                    __m256i pairs = _mm256_maddubs_epi16(v[c], four_bytes(a->q + 4 * c));
                    for (int e = 1; e < 4; e++)
                        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[c + e], four_bytes(a->q + 4 * (c + e))));
                    sum = _mm256_add_epi32(sum, widen(pairs));
                }
                lanes[0][t] = sum;
            }
        } else { /* Q5_0, two groups: each step made as it is read, the registers held by two groups' sums */
            for (int t = 0; t < tile; t++) {
                const act_block *a = x[t] + b;
                for (int n = 0; n < groups; n++) lanes[n][t] = _mm256_set1_epi32(-16 * (a->sum[0] + a->sum[1]));
            }
            const __m256i fifths[2] = {step_at(g[0] + 144), step_at(g[1] + 144)};
            for (int c0 = 0; c0 < 8; c0 += 4) { /* 16-bit sums of four steps: at most 4 x 2 x 31 x 127 */
                __m256i pairs[2][TILE];
                for (int n = 0; n < groups; n++)
                    for (int t = 0; t < tile; t++) pairs[n][t] = _mm256_setzero_si256();
                for (int c = c0; c < c0 + 4; c++) {
                    __m256i v[2];
                    for (int n = 0; n < groups; n++) {
                        const __m256i packed = step_at(g[n] + 16 + 32 * (c % 4));
                        v[n] = _mm256_or_si256(_mm256_and_si256(c < 4 ? packed : _mm256_srli_epi16(packed, 4), low),
                                               fifth_of(fifths[n], c));
                    }
                    for (int t = 0; t < tile; t++) {
                        const __m256i a = four_bytes(x[t][b].q + 4 * c);
                        for (int n = 0; n < groups; n++)
                            pairs[n][t] = _mm256_add_epi16(pairs[n][t], _mm256_maddubs_epi16(v[n], a));
                    }
                }
                for (int n = 0; n < groups; n++)
                    for (int t = 0; t < tile; t++) lanes[n][t] = _mm256_add_epi32(lanes[n][t], widen(pairs[n][t]));
            }
        }
        for (int n = 0; n < groups; n++) {
            const __m256 d = scales8(g[n]);
            for (int t = 0; t < tile; t++)
                acc[n][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes[n][t]),
                                            _mm256_mul_ps(d, _mm256_set1_ps(x[t][b].d)), acc[n][t]);
        }
    }
    store_sums(out, ldo, acc, groups, tile);
}

/* Q4_K_R8, `groups` (1 or 2) groups at once, at ga and gb: d * sum_j dx_j * scale_j * dot_j - dmin *
 * sum_j dx_j * min_j * xsum_j. Two groups (where few activation rows leave registers free) read two
 * runs of weights side by side and share each activation broadcast: decoding the 1.1B file (one row,
 * two threads, Xeon, after a 512-token prompt), 27.4 -> 31.0 tok/s. */
static inline __attribute__((always_inline)) void q4_k_groups(int64_t supers, int64_t group_bytes, int groups,
                                                            const uint8_t *ga, const uint8_t *gb,
                                                            const act_block *const *x, int tile, float *out_a,
                                                            float *out_b, int64_t ldo, int carry, int ahead) {
    const __m256i low = _mm256_set1_epi8(0x0f), six = _mm256_set1_epi8(63), top = _mm256_set1_epi8(0x30);
    const uint8_t *const g0[2] = {ga, gb};
    float *const out[2] = {out_a, out_b};
    __m256 total[2][TILE];
    start_sums(total, out, ldo, groups, tile, carry);
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *g[2] = {g0[0] + s * group_bytes, g0[1] + s * group_bytes};
        /* the 6-bit scales and minimums, [0] scales 0-3, [1] 4-7, [2] minimums 0-3, [3] 4-7: [sub-block][row] */
        uint8_t unpacked[2][4][32];
        for (int n = 0; n < groups; n++) {
            const __m256i pa = step_at(g[n] + 32), pb = step_at(g[n] + 64), pc = step_at(g[n] + 96);
            _mm256_storeu_si256((__m256i *)unpacked[n][0], _mm256_and_si256(pa, six));
            _mm256_storeu_si256((__m256i *)unpacked[n][1], _mm256_or_si256(
                _mm256_and_si256(pc, low), _mm256_and_si256(_mm256_srli_epi16(pa, 2), top)));
            _mm256_storeu_si256((__m256i *)unpacked[n][2], _mm256_and_si256(pb, six));
            _mm256_storeu_si256((__m256i *)unpacked[n][3], _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(pc, 4), low), _mm256_and_si256(_mm256_srli_epi16(pb, 2), top)));
        }
        __m256 acc[2][TILE], mins[2][TILE];
        zero_sums(acc, groups, tile);
        zero_sums(mins, groups, tile);
        for (int p = 0; p < 4; p++) {
            /* the bytes ahead asked for a quarter at each of the four sub-block pairs, not all at the super-block's
             * start. Why: there the two groups' 36 requests came at once, likely more than the core keeps in
             * flight, so it stalled on them and then computed with memory idle. Measured decoding one stream (two threads,
             * Zen 3, the builds in turn, each window held to a read probe on huge pages; 48 windows): the 1.1B
             * file 30.3 -> 36.1 tok/s (0.88 -> 1.03 of the probe), the 3B 11.1 -> 13.6 (0.89 -> 1.06); 8 and 32
             * streams level (1.04x, 1.02x). With the kernel reading its bytes and computing nothing, the old
             * requests reached 1.00 of the probe: the stall was the computing's. A request at every step instead
             * (a line every other step) was level with a quarter at each pair. */
            for (int n = 0; n < groups && ahead; n++) prefetch_part(g[n], group_bytes, p, 4);
            __m256i even[2][TILE], odd[2][TILE]; /* 16-bit: at most 8 steps x 2 x 15 x 127 */
            for (int n = 0; n < groups; n++)
                for (int t = 0; t < tile; t++) even[n][t] = odd[n][t] = _mm256_setzero_si256();
            /* the eight steps unrolled: the loop's count, compare and branch, and the moves between its turns, were a
             * tenth of a step's instructions. Measured with the avx2 kernels (two threads, Zen 5, the builds in
             * turn in one process, same bits): decoding 8 / 16 / 32 streams of the 1.1B file 1.03x / 1.05x /
             * 1.05x, 16 of the 3B 1.03x; one stream level (1.00x, 3B 0.995x), where the loop was no cost. */
            _Pragma("GCC unroll 8") for (int step = 0; step < 8; step++) {
                __m256i lo[2], hi[2];
                for (int n = 0; n < groups; n++) {
                    const __m256i packed = step_at(g[n] + 128 + (8 * p + step) * 32);
                    lo[n] = _mm256_and_si256(packed, low);
                    hi[n] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                }
                for (int t = 0; t < tile; t++) {
                    const act_block *first = x[t] + s * 8 + 2 * p;
                    const __m256i a_even = four_bytes(first->q + 4 * step);
                    const __m256i a_odd = four_bytes((first + 1)->q + 4 * step);
                    for (int n = 0; n < groups; n++) {
                        even[n][t] = _mm256_add_epi16(even[n][t], _mm256_maddubs_epi16(lo[n], a_even));
                        odd[n][t] = _mm256_add_epi16(odd[n][t], _mm256_maddubs_epi16(hi[n], a_odd));
                    }
                }
                /* the sums held in registers: left to itself the compiler kept one in memory, and each step waited
                 * on its store. Products of 64 and 512 rows (Q4_K 2048 x 2048, two threads, Xeon): 157 -> 170,
                 * 150 -> 159 GMAC/s. Of every tile (5632 x 2048, one thread, Zen 4, in cache, alternating in one
                 * process, same bits): one row 25.4 -> 28.0 and 26.0 -> 29.5 GB/s, two 16.8 -> 19.7, three
                 * 12.7 -> 15.3. */
                hold(even, groups, tile);
                hold(odd, groups, tile);
            }
            for (int n = 0; n < groups; n++) {
                __m256 scale[2], min[2];
                for (int j = 0; j < 2; j++) {
                    const int sub = 2 * p + j;
                    scale[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                        _mm_loadl_epi64((const __m128i *)(unpacked[n][sub / 4] + 8 * (sub % 4)))));
                    min[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                        _mm_loadl_epi64((const __m128i *)(unpacked[n][2 + sub / 4] + 8 * (sub % 4)))));
                }
                for (int t = 0; t < tile; t++) {
                    const act_block *first = x[t] + s * 8 + 2 * p, *second = first + 1;
                    acc[n][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(even[n][t])),
                                                _mm256_mul_ps(scale[0], _mm256_set1_ps(first->d)), acc[n][t]);
                    acc[n][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(odd[n][t])),
                                                _mm256_mul_ps(scale[1], _mm256_set1_ps(second->d)), acc[n][t]);
                    mins[n][t] = _mm256_fmadd_ps(min[0], _mm256_set1_ps(first->dsum), mins[n][t]);
                    mins[n][t] = _mm256_fmadd_ps(min[1], _mm256_set1_ps(second->dsum), mins[n][t]);
                }
            }
        }
        for (int n = 0; n < groups; n++) {
            const __m256 d = scales8(g[n]), dmin = scales8(g[n] + 16);
            for (int t = 0; t < tile; t++)
                total[n][t] = _mm256_fnmadd_ps(dmin, mins[n][t], _mm256_fmadd_ps(d, acc[n][t], total[n][t]));
        }
    }
    store_sums(out, ldo, total, groups, tile);
}

/* Q6_K_R8: the 2-bit high parts of step p (0-3) from their plane, placed at bits 4-5. */
static inline __m256i high_pair(__m256i plane, int p) {
    const int up = 4 - 2 * p; /* step p's two bits lie at bits 2p, 2p + 1 of each byte */
    const __m256i placed = up >= 0 ? _mm256_slli_epi16(plane, up) : _mm256_srli_epi16(plane, -up);
    return _mm256_and_si256(placed, _mm256_set1_epi8(0x30));
}

/* Q6_K_R8, `groups` (1 or 2) groups at once, as q4_k_groups takes them (decoding the 1.1B file, where
 * Q6_K holds the output projection and half the down projections: 32.5 -> 34.7 tok/s). Per 16 values
 * an 8-bit scale. The block's exact integer sum of each half's dot times its scale, which
 * interleaved.c forms in float (exact there, as it says), is formed here in integers: the pair sums'
 * widening multiplies by the scale (vpmaddwd), and the weights' offset of 32 comes off once per block
 * as 32 * (scale_0 * sum_0 + scale_1 * sum_1), one vpmaddwd of the two halves' activation sums. The
 * same value (below 2^24, so converted exactly; every partial sum below 2^26), so the same bits, in
 * fewer operations. Products of 64 and 512 rows (2048 x 5632, two threads, Xeon): 125 -> 138, 116 ->
 * 130 GMAC/s. */
static inline __attribute__((always_inline)) void q6_k_groups(int64_t supers, int64_t group_bytes, int groups,
                                                            const uint8_t *ga, const uint8_t *gb,
                                                            const act_block *const *x, int tile, float *out_a,
                                                            float *out_b, int64_t ldo, int carry, int ahead) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const uint8_t *const g0[2] = {ga, gb};
    float *const out[2] = {out_a, out_b};
    __m256 total[2][TILE];
    start_sums(total, out, ldo, groups, tile, carry);
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *g[2] = {g0[0] + s * group_bytes, g0[1] + s * group_bytes};
        __m256 acc[2][TILE];
        zero_sums(acc, groups, tile);
        for (int b = 0; b < 8; b++) {
            for (int n = 0; n < groups && ahead; n++) prefetch_part(g[n], group_bytes, b, 8); /* as q4_k_groups */
            __m256i scale[2][2], offset[2], dot[2][TILE];
            for (int n = 0; n < groups; n++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(g[n] + 16 + 16 * b)); /* half 0's 8, 1's 8 */
                /* each row's scale twice, as the 16-bit pair of its lane: half 0's, half 1's */
                scale[n][0] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(bytes, bytes));
                scale[n][1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(bytes, bytes));
                /* each row's (32 scale_0, 32 scale_1): at most 4096 */
                const __m128i halves = _mm_unpacklo_epi8(bytes, _mm_srli_si128(bytes, 8));
                offset[n] = _mm256_slli_epi16(_mm256_cvtepi8_epi16(halves), 5);
                for (int t = 0; t < tile; t++) dot[n][t] = _mm256_setzero_si256();
            }
            for (int c = 0; c < 8; c += 2) { /* 16-bit sums of two steps: at most 2 x 2 x 63 x 127 */
                __m256i v[2][2];
                for (int n = 0; n < groups; n++) {
                    const uint8_t *pb = g[n] + 144 + b * 192;
                    const __m256i high = step_at(pb + (c < 4 ? 128 : 160));
                    for (int e = 0; e < 2; e++) {
                        const int p = (c + e) % 4;
                        const __m256i bits = step_at(pb + 32 * p);
                        v[n][e] = _mm256_or_si256(_mm256_and_si256(c < 4 ? bits : _mm256_srli_epi16(bits, 4), low),
                                                  high_pair(high, p));
                    }
                }
                for (int t = 0; t < tile; t++) {
                    const act_block *a = x[t] + s * 8 + b;
                    const __m256i first = four_bytes(a->q + 4 * c), second = four_bytes(a->q + 4 * (c + 1));
                    for (int n = 0; n < groups; n++) {
                        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(v[n][0], first),
                                                               _mm256_maddubs_epi16(v[n][1], second));
                        dot[n][t] = _mm256_add_epi32(dot[n][t], _mm256_madd_epi16(pairs, scale[n][c / 4]));
                    }
                }
                /* the four rows' sums held in registers, as in q4_k_groups: products of 64 and 512 rows (3072 x
                 * 8192) 128 -> 137, 132 -> 144 GMAC/s. Not in the other tiles: one row lost 3-7% (2048 x 5632,
                 * one thread, Zen 4). */
                if (groups == 1 && tile == TILE) hold(dot, groups, tile);
            }
            for (int t = 0; t < tile; t++) {
                const act_block *a = x[t] + s * 8 + b;
                const __m256i sums = four_bytes((const int8_t *)a->sum);
                for (int n = 0; n < groups; n++) {
                    const __m256i exact = _mm256_sub_epi32(dot[n][t], _mm256_madd_epi16(offset[n], sums));
                    acc[n][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(a->d), acc[n][t]);
                }
            }
        }
        for (int n = 0; n < groups; n++) {
            const __m256 d = scales8(g[n]);
            for (int t = 0; t < tile; t++) total[n][t] = _mm256_fmadd_ps(d, acc[n][t], total[n][t]);
        }
    }
    store_sums(out, ldo, total, groups, tile);
}

/* Many activation rows (a batch of decoding streams, a prompt's rows): each group's segment of weights is
 * unpacked once into what the steps above make of them (the split nibbles, the fifth bits put in, Q8_0's
 * magnitudes and signs, the scales as floats or as 16-bit pairs), and every tile of four rows reads that.
 * Why: above, each tile makes them again, three of Q4_K's nineteen vector operations a step for four rows and
 * nine of Q6_K's twenty-nine for two steps, and this CPU is bound by the count of vector operations, not by
 * reading (interleaved_avx2.c's head). The integer dots and the float operations after them are the ones
 * above, in the same order: the same bits, whatever the batch. Measured (Zen 3, avx avx2, two threads, the builds
 * in turn in one process): products of 12 / 32 / 64 rows, Q4_K 2048 x 2048 1.14x / 1.22x / 1.36x, Q6_K 1.14x /
 * 1.26x / 1.39x, Q5_0 1.04x / 1.24x / 1.28x, Q8_0 1.06x / 1.20x / 1.23x; serving (bench/builds.py --clients, three
 * windows each, beside llama-server): 16 / 32 clients on the 1.1B file 1.05x / 1.15x (1.19x in a second run), on
 * the default model 1.17x / 1.13x. */
#define WIDE_SUPERS (SEGMENT / QK_K)
#define WIDE_BLOCKS (SEGMENT / QK)
typedef union {
    struct {
        __m256i q[WIDE_SUPERS][4][8][2]; /* [super][pair of sub-blocks][step]: low nibbles, high nibbles */
        __m256 scale[WIDE_SUPERS][8], min[WIDE_SUPERS][8], d[WIDE_SUPERS], dmin[WIDE_SUPERS];
    } q4_k;
    struct {
        __m256i v[WIDE_SUPERS][8][8];                             /* [super][block][step] */
        __m256i scale[WIDE_SUPERS][8][2], offset[WIDE_SUPERS][8]; /* each block's, as q6_k_groups makes them */
        __m256 d[WIDE_SUPERS];
    } q6_k;
    struct {
        __m256i v[WIDE_BLOCKS][8]; /* Q5_0's steps as 0..31 */
        __m256 d[WIDE_BLOCKS];
    } q5_0;
    struct {
        __m256i w[WIDE_BLOCKS][8], magnitude[WIDE_BLOCKS][8]; /* Q8_0's steps, signed, and their |w| */
        __m256 d[WIDE_BLOCKS];
    } q8_0;
} unpacked_segment;

/* The `count` super-blocks or blocks of one group (at g, group_bytes apart) into u: each step and scale as the
 * kernels above make it, written out here again rather than shared through helpers, since moving those kernels'
 * lines into helpers changed their code (the compiler allocated and ordered them otherwise) and the two-row path of
 * q6_k_groups ran 5% slower (Q6_K 2048 x 5632, two threads, Zen 3, alternating in one process). */
static void unpack_segment(int type, const uint8_t *g0, int64_t count, int64_t group_bytes, int ahead,
                           unpacked_segment *u) {
    const __m256i low = _mm256_set1_epi8(0x0f), six = _mm256_set1_epi8(63), top = _mm256_set1_epi8(0x30);
    for (int64_t s = 0; s < count; s++) {
        const uint8_t *g = g0 + s * group_bytes;
        if (ahead) prefetch_ahead(g, group_bytes);
        if (type == T_Q4_K_R8) {
            uint8_t unpacked[4][32]; /* as q4_k_groups */
            const __m256i pa = step_at(g + 32), pb = step_at(g + 64), pc = step_at(g + 96);
            _mm256_storeu_si256((__m256i *)unpacked[0], _mm256_and_si256(pa, six));
            _mm256_storeu_si256((__m256i *)unpacked[1], _mm256_or_si256(
                _mm256_and_si256(pc, low), _mm256_and_si256(_mm256_srli_epi16(pa, 2), top)));
            _mm256_storeu_si256((__m256i *)unpacked[2], _mm256_and_si256(pb, six));
            _mm256_storeu_si256((__m256i *)unpacked[3], _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(pc, 4), low), _mm256_and_si256(_mm256_srli_epi16(pb, 2), top)));
            for (int sub = 0; sub < 8; sub++) {
                u->q4_k.scale[s][sub] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(unpacked[sub / 4] + 8 * (sub % 4)))));
                u->q4_k.min[s][sub] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(unpacked[2 + sub / 4] + 8 * (sub % 4)))));
            }
            u->q4_k.d[s] = scales8(g);
            u->q4_k.dmin[s] = scales8(g + 16);
            for (int p = 0; p < 4; p++)
                for (int step = 0; step < 8; step++) {
                    const __m256i packed = step_at(g + 128 + (8 * p + step) * 32);
                    u->q4_k.q[s][p][step][0] = _mm256_and_si256(packed, low);
                    u->q4_k.q[s][p][step][1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                }
        } else if (type == T_Q6_K_R8) {
            u->q6_k.d[s] = scales8(g);
            for (int b = 0; b < 8; b++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(g + 16 + 16 * b));
                u->q6_k.scale[s][b][0] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(bytes, bytes));
                u->q6_k.scale[s][b][1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(bytes, bytes));
                const __m128i halves = _mm_unpacklo_epi8(bytes, _mm_srli_si128(bytes, 8));
                u->q6_k.offset[s][b] = _mm256_slli_epi16(_mm256_cvtepi8_epi16(halves), 5);
                const uint8_t *pb = g + 144 + b * 192;
                for (int c = 0; c < 8; c++) {
                    const int p = c % 4;
                    const __m256i bits = step_at(pb + 32 * p), high = step_at(pb + (c < 4 ? 128 : 160));
                    u->q6_k.v[s][b][c] = _mm256_or_si256(_mm256_and_si256(c < 4 ? bits : _mm256_srli_epi16(bits, 4), low),
                                                         high_pair(high, p));
                }
            }
        } else if (type == T_Q5_0_R8) {
            u->q5_0.d[s] = scales8(g);
            const __m256i fifths = step_at(g + 144);
            for (int c = 0; c < 4; c++) {
                const __m256i packed = step_at(g + 16 + 32 * c);
                u->q5_0.v[s][c] = _mm256_or_si256(_mm256_and_si256(packed, low), fifth_of(fifths, c));
                u->q5_0.v[s][c + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low),
                                                      fifth_of(fifths, c + 4));
            }
        } else {
            u->q8_0.d[s] = scales8(g);
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_xor_si256(step_at(g + 16 + 32 * c), _mm256_set1_epi8(-128));
                u->q8_0.w[s][c] = w;
                u->q8_0.magnitude[s][c] = _mm256_abs_epi8(w);
            }
        }
    }
}

/* One unpacked group against `tile` activation rows (x[t], `count` super-blocks or blocks), into out[t * ldo]:
 * q4_k_groups', q6_k_groups' and small_blocks_groups' sums of one group, from u. */
static inline __attribute__((always_inline)) void unpacked_tile(int type, const unpacked_segment *u, int64_t count,
                                                              const act_block *const *x, int tile, float *out,
                                                              int64_t ldo, int carry) {
    float *const outs[2] = {out, out};
    __m256 total[2][TILE];
    start_sums(total, outs, ldo, 1, tile, carry);
    for (int64_t s = 0; s < count; s++) {
        if (type == T_Q4_K_R8) {
            __m256 acc[2][TILE], mins[2][TILE];
            zero_sums(acc, 1, tile);
            zero_sums(mins, 1, tile);
            for (int p = 0; p < 4; p++) {
                __m256i even[2][TILE], odd[2][TILE];
                for (int t = 0; t < tile; t++) even[0][t] = odd[0][t] = _mm256_setzero_si256();
                _Pragma("GCC unroll 8") for (int step = 0; step < 8; step++) {
                    const __m256i lo = u->q4_k.q[s][p][step][0], hi = u->q4_k.q[s][p][step][1];
                    for (int t = 0; t < tile; t++) {
                        const act_block *first = x[t] + s * 8 + 2 * p;
                        even[0][t] = _mm256_add_epi16(even[0][t], _mm256_maddubs_epi16(lo, four_bytes(first->q + 4 * step)));
                        odd[0][t] = _mm256_add_epi16(odd[0][t],
                                                     _mm256_maddubs_epi16(hi, four_bytes((first + 1)->q + 4 * step)));
                    }
                    hold(even, 1, tile);
                    hold(odd, 1, tile);
                }
                const __m256 scale[2] = {u->q4_k.scale[s][2 * p], u->q4_k.scale[s][2 * p + 1]};
                const __m256 min[2] = {u->q4_k.min[s][2 * p], u->q4_k.min[s][2 * p + 1]};
                for (int t = 0; t < tile; t++) {
                    const act_block *first = x[t] + s * 8 + 2 * p, *second = first + 1;
                    acc[0][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(even[0][t])),
                                                _mm256_mul_ps(scale[0], _mm256_set1_ps(first->d)), acc[0][t]);
                    acc[0][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(odd[0][t])),
                                                _mm256_mul_ps(scale[1], _mm256_set1_ps(second->d)), acc[0][t]);
                    mins[0][t] = _mm256_fmadd_ps(min[0], _mm256_set1_ps(first->dsum), mins[0][t]);
                    mins[0][t] = _mm256_fmadd_ps(min[1], _mm256_set1_ps(second->dsum), mins[0][t]);
                }
            }
            for (int t = 0; t < tile; t++)
                total[0][t] = _mm256_fnmadd_ps(u->q4_k.dmin[s], mins[0][t],
                                               _mm256_fmadd_ps(u->q4_k.d[s], acc[0][t], total[0][t]));
        } else if (type == T_Q6_K_R8) {
            __m256 acc[2][TILE];
            zero_sums(acc, 1, tile);
            for (int b = 0; b < 8; b++) {
                __m256i dot[2][TILE];
                for (int t = 0; t < tile; t++) dot[0][t] = _mm256_setzero_si256();
                for (int c = 0; c < 8; c += 2) {
                    const __m256i v0 = u->q6_k.v[s][b][c], v1 = u->q6_k.v[s][b][c + 1];
                    const __m256i scale = u->q6_k.scale[s][b][c / 4];
                    for (int t = 0; t < tile; t++) {
                        const act_block *a = x[t] + s * 8 + b;
                        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(v0, four_bytes(a->q + 4 * c)),
                                                               _mm256_maddubs_epi16(v1, four_bytes(a->q + 4 * (c + 1))));
                        dot[0][t] = _mm256_add_epi32(dot[0][t], _mm256_madd_epi16(pairs, scale));
                    }
                    if (tile == TILE) hold(dot, 1, tile);
                }
                for (int t = 0; t < tile; t++) {
                    const act_block *a = x[t] + s * 8 + b;
                    const __m256i sums = four_bytes((const int8_t *)a->sum);
                    const __m256i exact = _mm256_sub_epi32(dot[0][t], _mm256_madd_epi16(u->q6_k.offset[s][b], sums));
                    acc[0][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(a->d), acc[0][t]);
                }
            }
            for (int t = 0; t < tile; t++) total[0][t] = _mm256_fmadd_ps(u->q6_k.d[s], acc[0][t], total[0][t]);
        } else {
            __m256i lanes[TILE];
            if (type == T_Q5_0_R8) {
                for (int t = 0; t < tile; t++) {
                    const act_block *a = x[t] + s;
                    __m256i sum = _mm256_set1_epi32(-16 * (a->sum[0] + a->sum[1]));
                    for (int c = 0; c < 8; c += 4) {
                        __m256i pairs = _mm256_maddubs_epi16(u->q5_0.v[s][c], four_bytes(a->q + 4 * c));
                        for (int e = 1; e < 4; e++)
                            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u->q5_0.v[s][c + e],
                                                                                 four_bytes(a->q + 4 * (c + e))));
                        sum = _mm256_add_epi32(sum, widen(pairs));
                    }
                    lanes[t] = sum;
                }
            } else {
                __m256i held[2][TILE];
                for (int t = 0; t < tile; t++) held[0][t] = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    const __m256i w = u->q8_0.w[s][c], magnitude = u->q8_0.magnitude[s][c];
                    for (int t = 0; t < tile; t++) {
                        const __m256i pairs = _mm256_maddubs_epi16(magnitude,
                                                                   _mm256_sign_epi8(four_bytes(x[t][s].q + 4 * c), w));
                        held[0][t] = _mm256_add_epi32(held[0][t], widen(pairs));
                    }
                    hold(held, 1, tile);
                }
                for (int t = 0; t < tile; t++) lanes[t] = held[0][t];
            }
            const __m256 d = type == T_Q5_0_R8 ? u->q5_0.d[s] : u->q8_0.d[s];
            for (int t = 0; t < tile; t++)
                total[0][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes[t]), _mm256_mul_ps(d, _mm256_set1_ps(x[t][s].d)),
                                              total[0][t]);
        }
    }
    store_sums(outs, ldo, total, 1, tile);
}

void llorch_interleaved_wide(int type, const uint8_t *w, int64_t k, int64_t ga, int64_t gb, const act_block *x,
                             int64_t stride, int64_t rows, float *out, int64_t ldo, int carry, int ahead) {
    const int64_t group_bytes = llorch_group_bytes(type);
    const int is_k = type == T_Q4_K_R8 || type == T_Q6_K_R8;
    const int64_t count = is_k ? k / QK_K : k / QK, span = count * group_bytes;
    unpacked_segment u;
    for (int n = 0; n < (gb != ga ? 2 : 1); n++) {
        const int64_t group = n == 0 ? ga : gb;
        unpack_segment(type, w + group * span, count, group_bytes, ahead, &u);
        for (int64_t i = 0; i < rows; i += TILE) {
            const int tile = rows - i < TILE ? (int)(rows - i) : TILE;
            const act_block *tiled[TILE];
            for (int t = 0; t < tile; t++) tiled[t] = x + (i + t) * stride;
            float *at = out + i * ldo + ROWS * group;
#define UNPACKED(n)                                                                          \
    do {                                                                                     \
        if (type == T_Q4_K_R8) unpacked_tile(T_Q4_K_R8, &u, count, tiled, n, at, ldo, carry); \
        else if (type == T_Q6_K_R8) unpacked_tile(T_Q6_K_R8, &u, count, tiled, n, at, ldo, carry); \
        else if (type == T_Q5_0_R8) unpacked_tile(T_Q5_0_R8, &u, count, tiled, n, at, ldo, carry); \
        else unpacked_tile(T_Q8_0_R8, &u, count, tiled, n, at, ldo, carry);                  \
    } while (0)
            BY_TILE(UNPACKED);
#undef UNPACKED
        }
    }
}

/* Groups ga and gb of the matrix at w (`groups` of them: 1, ga alone, or 2), `tile` activation rows. */
static inline __attribute__((always_inline)) void some_groups(int type, const uint8_t *w, int64_t k, int groups,
                                                            int64_t ga, int64_t gb, const act_block *const *x,
                                                            int tile, float *out, int64_t ldo, int carry,
                                                            int ahead) {
    const int64_t group_bytes = llorch_group_bytes(type);
    const int is_k = type == T_Q4_K_R8 || type == T_Q6_K_R8;
    const int64_t count = is_k ? k / QK_K : k / QK, span = count * group_bytes; /* super-blocks or blocks */
    const uint8_t *wa = w + ga * span, *wb = w + gb * span;
    float *out_a = out + ROWS * ga, *out_b = out + ROWS * gb;
    if (type == T_Q4_K_R8) q4_k_groups(count, group_bytes, groups, wa, wb, x, tile, out_a, out_b, ldo, carry, ahead);
    else if (type == T_Q6_K_R8)
        q6_k_groups(count, group_bytes, groups, wa, wb, x, tile, out_a, out_b, ldo, carry, ahead);
    else small_blocks_groups(type, count, group_bytes, groups, wa, wb, x, tile, out_a, out_b, ldo, carry, ahead);
}

void llorch_interleaved_groups(int type, const uint8_t *w, int64_t k, int64_t ga, int64_t gb,
                               const act_block *const *x, int tile, float *out, int64_t ldo, int carry, int ahead) {
    if (gb != ga && tile <= 2) { /* the two groups together where one or two activation rows leave the registers */
        if (tile == 1) some_groups(type, w, k, 2, ga, gb, x, 1, out, ldo, carry, ahead);
        else some_groups(type, w, k, 2, ga, gb, x, 2, out, ldo, carry, ahead);
        return;
    }
#define GROUPS(n)                                                           \
    do {                                                                    \
        some_groups(type, w, k, 1, ga, ga, x, n, out, ldo, carry, ahead);          \
        if (gb != ga) some_groups(type, w, k, 1, gb, gb, x, n, out, ldo, carry, ahead); \
    } while (0)
    BY_TILE(GROUPS);
#undef GROUPS
}
#endif
