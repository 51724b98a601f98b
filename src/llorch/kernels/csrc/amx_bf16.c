/* AMX-BF16 kernels for a prompt's rows against the interleaved layouts (repack.c), in the `amx`
 * variant only: the weights dequantized to bfloat16 once per product, the activations rounded to
 * bfloat16, and the tile unit's float32 sums running over the whole row.
 *
 * Why not the int8 tiles (amx.c) for these rows: each 32-value block's integer dot has to be scaled
 * by its own activation scale in float, per row, which bounds that kernel at a tenth of the tile
 * unit's rate. Here no block is scaled apart. Products of 512 rows against the int8 tiles, Xeon with AMX,
 * one / two threads: Q4_K 2048 x 2048 207 -> 453 / 352 -> 698 GMAC/s, Q6_K 2048 x 5632 132 -> 329 /
 * 259 -> 573 (a unit reads every row's activations from the last-level cache at that width).
 *
 * Numbers: a bfloat16 keeps 8 significant bits of every value, where an int8 block keeps 7 of its
 * largest: the activations lose less than the 8-bit kernels' blocks of 32 lose, and each weight
 * is its file value to within 2^-9. So these rows are not the 8-bit kernels' bits: the decoder
 * (decoder.c) gives them only a prompt's own tokens, which no other path ever computes, so that a
 * job's tokens still do not depend on what it was batched with (see README).
 */
#include <stdlib.h>

#include "groups.h"

#if defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && \
    defined(LLORCH_VNNI)

#define TILE_ROWS 16
#define UNIT_GROUPS 4 /* weight groups of eight per unit of work: two B tiles */

typedef uint16_t bf16_tile[TILE_ROWS][32]; /* 16 rows x 64 bytes: A [row][32 values], B [value pair][16 x 2] */

int llorch_bf16_takes(const matrix *mats, int count) {
    for (int i = 0; i < count; i++)
        if (mats[i].type <= REPACKED || llorch_group_bytes(mats[i].type) == 0) return 0;
    return llorch_amx_ready();
}

int64_t llorch_bf16_acts_values(int64_t m, int64_t k) { return (m + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS * k; }

void llorch_bf16_pack_ws(const float *x, int64_t m, int64_t k, uint16_t *out) {
    const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS, blocks = k / QK;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t item = 0; item < tiles * blocks; item++) {
        const int64_t t = item / blocks, b = item % blocks;
        uint16_t *tile = out + item * TILE_ROWS * QK; /* [tile][block][row][32] */
        for (int r = 0; r < TILE_ROWS; r++) {
            const int64_t row = t * TILE_ROWS + r;
            __m512i both = _mm512_setzero_si512(); /* rows past m: zeros, whose results are not stored */
            if (row < m) {
                const float *at = x + row * k + b * QK;
                both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(at + 16), _mm512_loadu_ps(at));
            }
            _mm512_store_si512(tile + r * QK, both);
        }
    }
}

/* Values a (pair element 0) and b (element 1) of sixteen weight rows as one B-tile row of pairs. */
static inline __m512i pairs(__m512 a, __m512 b) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* Groups ga and gb (eight weight rows each) dequantized into B tiles, one per block of 32 values:
 * each weight as the file gives it (scale times value, less the minimum), rounded to bfloat16. */
static void dequantize(int type, const uint8_t *w, int64_t groups, int64_t k, int64_t ga, int64_t gb, bf16_tile *out) {
    const int64_t blocks = k / QK, spans = (blocks + SUB - 1) / SUB;
    span sp;
    for (int64_t s = 0; s < spans; s++) {
        llorch_amx_unpack_span(type, w, groups, k, ga, gb, s, &sp);
        for (int blk = 0; blk < sp.blocks; blk++) {
            uint16_t(*tile)[32] = out[s * SUB + blk];
            __m512 scales[2], offset = _mm512_setzero_ps(); /* each half block's scale */
            if (type == T_Q4_K_R8) {
                scales[0] = scales[1] = _mm512_mul_ps(sp.d, sp.scale[blk]);
                offset = _mm512_mul_ps(sp.dmin, sp.min[blk]);
            } else if (type == T_Q6_K_R8) {
                scales[0] = _mm512_mul_ps(sp.d, sp.iscale[blk][0]);
                scales[1] = _mm512_mul_ps(sp.d, sp.iscale[blk][1]);
            } else {
                scales[0] = scales[1] = sp.scale[blk];
            }
            for (int step = 0; step < 8; step++) {
                const __m512 scale = scales[step / 4];
                /* lane r: weight row r's four values 4 step .. 4 step + 3, one byte each */
                const __m512i four = _mm512_load_si512(sp.b[blk][step]);
                __m512 v[4];
                for (int i = 0; i < 4; i++) {
                    const __m512i value = _mm512_srai_epi32(_mm512_slli_epi32(four, 24 - 8 * i), 24);
                    v[i] = _mm512_fmsub_ps(scale, _mm512_cvtepi32_ps(value), offset);
                }
                _mm512_store_si512(tile[2 * step], pairs(v[0], v[1]));
                _mm512_store_si512(tile[2 * step + 1], pairs(v[2], v[3]));
            }
        }
    }
}

/* Per-thread room for one unit's two columns of B tiles (llorch_grow). */
static __thread void *unit_tiles;
static __thread size_t unit_capacity;

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* C tiles 0-3 (16 x 16 float), A tiles 4-5, B tiles 6-7: every one 16 rows of 64 bytes. Set on each
 * product: the int8 kernels (amx.c) configure the tiles otherwise, and forget nothing by it. */
static void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = TILE_ROWS, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* C tile `tile`'s rows [0, rows) and columns [0, cols) into out (ldo floats a row). */
static inline void store(int tile, float *out, int64_t ldo, int64_t rows, int cols) {
    if (rows >= TILE_ROWS && cols == 16) {
        switch (tile) {
        case 0: _tile_stored(0, out, ldo * 4); break;
        case 1: _tile_stored(1, out, ldo * 4); break;
        case 2: _tile_stored(2, out, ldo * 4); break;
        default: _tile_stored(3, out, ldo * 4); break;
        }
        return;
    }
    float c[TILE_ROWS][16] __attribute__((aligned(64)));
    switch (tile) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
    }
    for (int64_t r = 0; r < rows && r < TILE_ROWS; r++) memcpy(out + r * ldo, c[r], sizeof(float) * (size_t)cols);
}

/* One unit: up to four groups from `first` of a matrix of `groups` groups, against every tile of rows,
 * two tiles of rows by two of weight rows at a time. */
static void unit(const matrix *W, int64_t first, int64_t groups, const uint16_t *acts, int64_t m, float *out) {
    const int64_t k = W->cols, blocks = k / QK, tiles = (m + TILE_ROWS - 1) / TILE_ROWS, n = W->rows;
    bf16_tile *b = llorch_grow(&unit_tiles, &unit_capacity, sizeof(bf16_tile) * (size_t)(2 * blocks));
    if (b == NULL) return; /* the step fails (alloc.c) */
    const int64_t last = first + UNIT_GROUPS < groups ? first + UNIT_GROUPS : groups; /* groups [first, last) */
    int cols[2];
    for (int half = 0; half < 2; half++) {
        const int64_t ga = first + 2 * half < last ? first + 2 * half : first, gb = ga + 1 < last ? ga + 1 : ga;
        cols[half] = first + 2 * half >= last ? 0 : gb > ga ? 16 : 8;
        dequantize(W->type, W->data, n / 8, k, ga, gb, b + half * blocks);
    }
    configure();
    for (int64_t t = 0; t < tiles; t += 2) {
        const uint16_t *a0 = acts + t * blocks * TILE_ROWS * QK;
        const uint16_t *a1 = t + 1 < tiles ? a0 + blocks * TILE_ROWS * QK : a0; /* a lone last tile: twice */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t blk = 0; blk < blocks; blk++) {
            _tile_loadd(4, a0 + blk * TILE_ROWS * QK, 64);
            _tile_loadd(6, b[blk], 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b[blocks + blk], 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a1 + blk * TILE_ROWS * QK, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        float *row0 = out + t * TILE_ROWS * n + 8 * first;
        const int64_t rows0 = m - t * TILE_ROWS, rows1 = t + 1 < tiles ? rows0 - TILE_ROWS : 0;
        store(0, row0, n, rows0, cols[0]);
        if (cols[1]) store(1, row0 + 16, n, rows0, cols[1]);
        if (rows1 > 0) {
            store(2, row0 + TILE_ROWS * n, n, rows1, cols[0]);
            if (cols[1]) store(3, row0 + TILE_ROWS * n + 16, n, rows1, cols[1]);
        }
    }
}

void llorch_bf16_matmul_ws(const matrix *mats, int count, const uint16_t *acts, int64_t m, float *const *outs) {
    int64_t first_unit[4] = {0, 0, 0, 0};
    for (int i = 0; i < count; i++)
        first_unit[i + 1] = first_unit[i] + (mats[i].rows / 8 + UNIT_GROUPS - 1) / UNIT_GROUPS;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t u = 0; u < first_unit[count]; u++) {
        const int which = matrix_of(first_unit, u);
        const matrix *W = mats + which;
        unit(W, (u - first_unit[which]) * UNIT_GROUPS, W->rows / 8, acts, m, outs[which]);
    }
}
#else
int llorch_bf16_takes(const matrix *mats, int count) {
    (void)mats; (void)count;
    return 0;
}

int64_t llorch_bf16_acts_values(int64_t m, int64_t k) {
    (void)m; (void)k;
    return 0;
}

/* Never called: llorch_bf16_takes takes no matrix without AMX-BF16. */
void llorch_bf16_pack_ws(const float *x, int64_t m, int64_t k, uint16_t *out) {
    (void)x; (void)m; (void)k; (void)out;
}

void llorch_bf16_matmul_ws(const matrix *mats, int count, const uint16_t *acts, int64_t m, float *const *outs) {
    (void)mats; (void)count; (void)acts; (void)m; (void)outs;
}
#endif
