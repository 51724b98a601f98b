/* AMX kernels for the interleaved layouts (repack.c): sixteen activation rows at a time against
 * sixteen weight rows (two groups of eight), in the `amx` variant only.
 *
 * Why: once a prompt chunk or a batch of decoding rows shares the weights, the 8-bit dot
 * instructions bound the interleaved kernels (interleaved.c); one AMX tile instruction does
 * 16 x 16 x 32 of those multiply-adds. A chunk's two groups are unpacked once into tile form
 * (signed bytes, the layout's offset taken out) and read by every tile of activation rows,
 * which are regrouped once per product so that a tile's rows are one contiguous load.
 * What bounds it is the float scaling of each block's dots (four vector operations per activation
 * row, 16 weight rows and 32 values: the same operations as interleaved.c's, which the same bits
 * require), then the tile instructions themselves: on the Xeon measured, the tile unit's work and
 * the vector units' did not overlap, however interleaved (in a loop of them alone, the tile loads
 * and dots took 0.3 ns per row and block and the scaling 1.0; together, with the tile stores,
 * 1.6-1.7). The next span's dots are still issued between parts of the current span's scaling, so
 * that a tile store's wait for its dot is spent scaling. Measured against the avx512-vnni variant in one process (Xeon with
 * AMX, two threads):
 * prefill of 512 tokens, the default model 1366 -> 1768 tok/s, the 1.1B file 214 -> 262;
 * products of 512 rows, Q4_K 2048 x 2048 265 -> 354 GMAC/s, Q5_0 2048 x 640 220 -> 369.
 *
 * Same bits as interleaved.c: a tile instruction gives each (activation row, weight row,
 * block or sub-block) the same exact integer dot the 8-bit instructions do, and the float
 * multiply-adds that scale them run per row in the same order, on the same operands. So a
 * row's result does not depend on whether AMX computed it, and batch invariance holds
 * across the rows AMX takes and those left to interleaved.c (llorch_amx_rows).
 *
 * Linux gives a process the tile registers only when it asks (arch_prctl); if it refuses,
 * these kernels are not used and the interleaved ones compute every row.
 */
#include <stdlib.h>

#include "groups.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(LLORCH_VNNI)
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_ROWS 16 /* activation rows per tile */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_granted;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void request_tiles(void) { amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

int llorch_amx_ready(void) {
    pthread_once(&amx_once, request_tiles);
    return amx_granted;
}

/* Below 32 rows (16 for Q5_0) the 8-bit dot kernels were as fast or faster: the unpacking and the
 * tile stores are paid for few rows. Measured against them (best of 15, Xeon, two threads), 16 /
 * 24 / 32 / 48 rows: Q4_K 2048 x 2048 0.90 / 0.95 / 1.09 / 1.17x, Q6_K 2048 x 5632 0.88 / 0.94 /
 * 0.99 / 1.04x, Q8_0 2048 x 640 1.00 / 0.90 / 1.04 / 1.30x, Q5_0 2048 x 640 1.22 / 0.98 / 1.38 /
 * 1.53x. */
int64_t llorch_amx_rows(int type, int64_t m) {
    if (m < (type == T_Q5_0_R8 ? TILE_ROWS : 2 * TILE_ROWS) || type <= REPACKED || !llorch_amx_ready()) return 0;
    return m / TILE_ROWS * TILE_ROWS;
}

/* The tile palette: C tiles 0-3 (16 x 16 int32); A tiles 4, 5 (16 rows x `k` activation bytes);
 * B tiles 6, 7 (k / 4 rows of 16 weight rows x 4 bytes). k = 32 for a block's dot, 16 for the
 * halves of a Q6_K block, which are scaled apart. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Configures this thread's tiles for k unless *configured_k says they are. Why the caller keeps it,
 * per product, and not the thread: other code on the thread (a BLAS library's own AMX kernels)
 * may configure the tiles between two products. */
static void configure(int k, int *configured_k) {
    if (*configured_k == k) return;
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = TILE_ROWS, c.colsb[t] = 64;
    for (int t = 4; t < 6; t++) c.rows[t] = TILE_ROWS, c.colsb[t] = (uint16_t)k;
    for (int t = 6; t < 8; t++) c.rows[t] = (uint8_t)(k / 4), c.colsb[t] = 64;
    _tile_loadconfig(&c);
    *configured_k = k;
}

void llorch_amx_unpack_span(int type, const uint8_t *w, int64_t groups, int64_t k, int64_t group_a, int64_t group_b,
                            int64_t s, span *out) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int64_t group_bytes = llorch_group_bytes(type), block_values = llorch_block_values(type), blocks = k / QK;
    /* the span's first block of each group: a span's blocks lie together (SEGMENT is whole spans) */
    const int64_t first = block_values == QK_K ? s : s * SUB;
    const uint8_t *wa = w + llorch_block_at(group_bytes, block_values, groups, k, group_a, first);
    const uint8_t *wb = w + llorch_block_at(group_bytes, block_values, groups, k, group_b, first);
    if (type == T_Q4_K_R8) {
        const uint8_t *ga = wa, *gb = wb;
        out->blocks = SUB;
        for (int p = 0; p < 4; p++) {
            for (int step = 0; step < 8; step++) {
                const __m512i packed = two_steps(ga + 128 + (8 * p + step) * 32, gb + 128 + (8 * p + step) * 32);
                _mm512_store_si512(out->b[2 * p][step], _mm512_and_si512(packed, low));
                _mm512_store_si512(out->b[2 * p + 1][step], _mm512_and_si512(_mm512_srli_epi16(packed, 4), low));
            }
        }
        uint8_t unpacked[4][64];
        q4_k_scales(ga, gb, unpacked);
        for (int sub = 0; sub < SUB; sub++) {
            out->scale[sub] = q4_k_sub(unpacked, 0, sub);
            out->min[sub] = q4_k_sub(unpacked, 2, sub);
        }
        out->d = two_scales(ga, gb);
        out->dmin = two_scales(ga + 16, gb + 16);
    } else if (type == T_Q6_K_R8) {
        const uint8_t *ga = wa, *gb = wb;
        out->blocks = SUB;
        for (int blk = 0; blk < SUB; blk++) {
            const uint8_t *pa = ga + 144 + blk * 192, *pb = gb + 144 + blk * 192;
            const uint8_t *sa = ga + 16 + 16 * blk, *sb = gb + 16 + 16 * blk;
            out->iscale[blk][0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(two_halves(sa, sb)));
            out->iscale[blk][1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(two_halves(sa + 8, sb + 8)));
            const __m512i high0 = two_steps(pa + 128, pb + 128), high1 = two_steps(pa + 160, pb + 160);
            const __m512i offset = _mm512_set1_epi8(32);
            for (int p = 0; p < 4; p++) {
                const __m512i bits = two_steps(pa + 32 * p, pb + 32 * p);
                const __m512i first = _mm512_or_si512(_mm512_and_si512(bits, low), high_pair512(high0, p));
                const __m512i second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bits, 4), low),
                                                       high_pair512(high1, p));
                _mm512_store_si512(out->b[blk][p], _mm512_sub_epi8(first, offset));
                _mm512_store_si512(out->b[blk][p + 4], _mm512_sub_epi8(second, offset));
            }
        }
        out->d = two_scales(ga, gb);
    } else { /* Q8_0_R8, Q5_0_R8: blocks of 32, each with its own scale */
        out->blocks = (int)(blocks - first < SUB ? blocks - first : SUB);
        for (int blk = 0; blk < out->blocks; blk++) {
            const uint8_t *ga = wa + blk * group_bytes, *gb = wb + blk * group_bytes;
            out->scale[blk] = two_scales(ga, gb);
            if (type == T_Q8_0_R8) {
                for (int step = 0; step < 8; step++) {
                    const __m512i stored = two_steps(ga + 16 + 32 * step, gb + 16 + 32 * step); /* value + 128 */
                    _mm512_store_si512(out->b[blk][step], _mm512_xor_si512(stored, _mm512_set1_epi8((char)0x80)));
                }
            } else {
                __m512i v[8];
                q5_0_steps(ga, gb, v);
                for (int c = 0; c < 8; c++)
                    _mm512_store_si512(out->b[blk][c], _mm512_sub_epi8(v[c], _mm512_set1_epi8(16)));
            }
        }
    }
}

void llorch_amx_pack_ws(const act_block *xq, int64_t tiles, int64_t blocks, const amx_acts *out) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t item = 0; item < tiles * blocks; item++) {
        const int64_t t = item / blocks, b = item % blocks;
        for (int r = 0; r < TILE_ROWS; r++) {
            const act_block *a = xq + (t * TILE_ROWS + r) * blocks + b;
            memcpy(out->q + (item * TILE_ROWS + r) * QK, a->q, QK);
            out->d[item * TILE_ROWS + r] = a->d;
            out->dsum[item * TILE_ROWS + r] = a->dsum;
        }
    }
}

typedef int32_t dots[TILE_ROWS][16]; /* one tile's exact integer dots: [activation row][weight row] */

#define PARTS 4 /* a tile's dots and its scaling, each in four parts, interleaved (llorch_amx_groups) */

/* Part `part` of the dots of a tile's activation rows (q: their values at the span's first block, as
 * llorch_amx_pack_ws lays them out) with the span's weights: blocks 2 part and 2 part + 1, or for
 * Q6_K the halves of those blocks (scaled apart). They are left in C tiles 0-1 (even parts) or
 * 2-3 (odd parts; Q6_K: all four) until dots_store takes them out: a tile store waits for its dot,
 * so the caller runs other work between the two. */
static inline void dots_part(int type, const span *sp, const int8_t *q, int part) {
#define DOT(C, A, B, i, h)                                                    \
    do {                                                                      \
        _tile_loadd(A, q + (i) * TILE_ROWS * QK + 16 * (h), QK);              \
        _tile_loadd(B, sp->b[i][4 * (h)], 64);                                \
        _tile_zero(C);                                                        \
        _tile_dpbssd(C, A, B);                                                \
    } while (0)
    const int i = 2 * part;
    if (type == T_Q6_K_R8) {
        DOT(0, 4, 6, i, 0);
        DOT(1, 5, 7, i, 1);
        DOT(2, 4, 6, i + 1, 0);
        DOT(3, 5, 7, i + 1, 1);
    } else if (part % 2 == 0) {
        if (i < sp->blocks) DOT(0, 4, 6, i, 0);
        if (i + 1 < sp->blocks) DOT(1, 5, 7, i + 1, 0);
    } else {
        if (i < sp->blocks) DOT(2, 4, 6, i, 0);
        if (i + 1 < sp->blocks) DOT(3, 5, 7, i + 1, 0);
    }
#undef DOT
}

/* dots_part's results into c[block] (Q6_K: c[2 block + half]). */
static inline void dots_store(int type, const span *sp, int part, dots *c) {
    const int i = 2 * part;
    if (type == T_Q6_K_R8) {
        _tile_stored(0, c[2 * i], 64);
        _tile_stored(1, c[2 * i + 1], 64);
        _tile_stored(2, c[2 * i + 2], 64);
        _tile_stored(3, c[2 * i + 3], 64);
    } else if (part % 2 == 0) {
        if (i < sp->blocks) _tile_stored(0, c[i], 64);
        if (i + 1 < sp->blocks) _tile_stored(1, c[i + 1], 64);
    } else {
        if (i < sp->blocks) _tile_stored(2, c[i], 64);
        if (i + 1 < sp->blocks) _tile_stored(3, c[i + 1], 64);
    }
}

static inline __m512 load_pair(const float *a, const float *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

static inline void store_pair(float *a, float *b, __m512 v) {
    _mm256_storeu_ps(a, _mm512_castps512_ps256(v));
    if (b != a) _mm256_storeu_ps(b, _mm512_extractf32x8_ps(v, 1));
}

#define QUARTER (TILE_ROWS / PARTS)

/* Rows r0..r0 + 3 of a tile, whose activation scales (d, dsum: [block][row], from the span's first
 * block) llorch_amx_pack_ws laid out: their dots scaled as interleaved.c scales them, into out_a /
 * out_b (lanes 0-7, 8-15), which hold the sum of the earlier spans (first: none). Four rows at
 * once: four independent chains. */
static inline void scale_quarter(int type, const span *sp, const dots *c, const float *d, const float *dsum,
                                 int first, int r0, float *out_a, float *out_b, int64_t ldo) {
    __m512 total[QUARTER], acc[QUARTER], mins[QUARTER];
    for (int t = 0; t < QUARTER; t++) {
        total[t] = first ? _mm512_setzero_ps() : load_pair(out_a + (r0 + t) * ldo, out_b + (r0 + t) * ldo);
        acc[t] = mins[t] = _mm512_setzero_ps();
    }
    if (type == T_Q4_K_R8) {
        for (int j = 0; j < SUB; j++) {
            for (int t = 0; t < QUARTER; t++) {
                const int64_t at = j * TILE_ROWS + r0 + t;
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[j][r0 + t])),
                                         _mm512_mul_ps(sp->scale[j], _mm512_set1_ps(d[at])), acc[t]);
                mins[t] = _mm512_fmadd_ps(sp->min[j], _mm512_set1_ps(dsum[at]), mins[t]);
            }
        }
        for (int t = 0; t < QUARTER; t++)
            total[t] = _mm512_fnmadd_ps(sp->dmin, mins[t], _mm512_fmadd_ps(sp->d, acc[t], total[t]));
    } else if (type == T_Q6_K_R8) {
        for (int j = 0; j < SUB; j++) {
            for (int t = 0; t < QUARTER; t++) {
                /* the halves' dots times their scales, summed in float: exact, as in interleaved.c (there
                 * measured; here, products of 512 rows 2048 x 2048 222 -> 239 GMAC/s, 2048 x 5632 202 -> 216) */
                const __m512 low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[2 * j][r0 + t])),
                                                 sp->iscale[j][0]);
                const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[2 * j + 1][r0 + t])),
                                                    sp->iscale[j][1], low);
                acc[t] = _mm512_fmadd_ps(both, _mm512_set1_ps(d[j * TILE_ROWS + r0 + t]), acc[t]);
            }
        }
        for (int t = 0; t < QUARTER; t++) total[t] = _mm512_fmadd_ps(sp->d, acc[t], total[t]);
    } else { /* one running sum over every block, as interleaved.c keeps it */
        for (int j = 0; j < sp->blocks; j++) {
            for (int t = 0; t < QUARTER; t++) {
                total[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[j][r0 + t])),
                                           _mm512_mul_ps(sp->scale[j], _mm512_set1_ps(d[j * TILE_ROWS + r0 + t])),
                                           total[t]);
            }
        }
    }
    for (int t = 0; t < QUARTER; t++) store_pair(out_a + (r0 + t) * ldo, out_b + (r0 + t) * ldo, total[t]);
}

/* Per-thread room for one chunk's unpacked spans (llorch_grow). */
static __thread void *chunk_spans;
static __thread size_t chunk_capacity;

void llorch_amx_groups(int type, const uint8_t *w, int64_t rows, int64_t k, int64_t ga, int64_t gb,
                       const amx_acts *x, int64_t tiles, float *out, int64_t ldo, int *configured_k) {
    const int64_t blocks = k / QK, spans = (blocks + SUB - 1) / SUB;
    float *out_a = out + 8 * ga, *out_b = out + 8 * gb;
    span *sp = llorch_grow(&chunk_spans, &chunk_capacity, sizeof(span) * (size_t)spans);
    if (sp == NULL) return; /* the step fails (alloc.c) */
    dots c[2][2 * SUB] __attribute__((aligned(64))); /* two spans' dots: one scaled while the next is made */
    configure(type == T_Q6_K_R8 ? 16 : 32, configured_k);
    for (int64_t s = 0; s < spans; s++) llorch_amx_unpack_span(type, w, rows / 8, k, ga, gb, s, sp + s);
    /* One tile of rows at a time through every span, so that its outputs stay in cache; span s + 1's
     * dots are issued in parts between the parts of span s's scaling (see the top of this file). */
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = t * blocks * TILE_ROWS; /* the tile's first block, in act rows x blocks */
        float *ta = out_a + t * TILE_ROWS * ldo, *tb = out_b + t * TILE_ROWS * ldo;
        for (int part = 0; part < PARTS; part++) {
            dots_part(type, sp, x->q + first * QK, part);
            dots_store(type, sp, part, c[0]);
        }
        for (int64_t s = 0; s < spans; s++) {
            const int64_t at = first + s * SUB * TILE_ROWS, next = at + SUB * TILE_ROWS;
            for (int part = 0; part < PARTS; part++) {
                if (s + 1 < spans) dots_part(type, sp + s + 1, x->q + next * QK, part);
                scale_quarter(type, sp + s, c[s % 2], x->d + at, x->dsum + at, s == 0, part * QUARTER, ta, tb, ldo);
                if (s + 1 < spans) dots_store(type, sp + s + 1, part, c[(s + 1) % 2]);
            }
        }
    }
}
#else
int llorch_amx_ready(void) { return 0; }

int64_t llorch_amx_rows(int type, int64_t m) {
    (void)type; (void)m;
    return 0;
}

/* Never called: llorch_amx_rows gives no rows without AMX. */
void llorch_amx_pack_ws(const act_block *xq, int64_t tiles, int64_t blocks, const amx_acts *out) {
    (void)xq; (void)tiles; (void)blocks; (void)out;
}

void llorch_amx_groups(int type, const uint8_t *w, int64_t rows, int64_t k, int64_t ga, int64_t gb,
                       const amx_acts *x, int64_t tiles, float *out, int64_t ldo, int *configured_k) {
    (void)type; (void)w; (void)rows; (void)k; (void)ga; (void)gb; (void)x; (void)tiles; (void)out; (void)ldo; (void)configured_k;
}
#endif
