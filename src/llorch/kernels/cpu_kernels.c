/* CPU kernels for decoding: int8 block-quantized matrices, and RMSNorm.
 *
 * A weight matrix [n, k] is stored as int8 values [n, k] plus one float scale per
 * 32-value block [n, k/32]. Decoding multiplies it by a few rows of activations,
 * which stay float32: the weights are widened in registers, so memory traffic is a
 * quarter of a float32 matrix and a one-row product runs near memory bandwidth,
 * which is what bounds decode speed. Each output is summed in the same order
 * whatever the number of rows, so a row's result does not depend on its batch.
 *
 * Built on the machine that runs it (see build.py), so -march=native is safe.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QBLOCK 32
#define ROW_CHUNK 16 /* weight rows per scheduling unit */
#define ROW_TILE 4   /* activation rows that share one widened weight block */

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* The 32 values of one weight block as four vectors of eight floats. */
static inline void widen_block(const int8_t *w, __m256 out[4]) {
    for (int part = 0; part < 4; part++) {
        out[part] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + 8 * part))));
    }
}

/* Eight float lanes of one block product; always this order, whatever the tile. */
static inline __m256 block_dot(const __m256 w[4], const float *x) {
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(x), w[0]);
    sum = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w[1], sum);
    sum = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w[2], sum);
    return _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w[3], sum);
}
#endif

#ifdef __AVX2__
/* One weight row against `tile` activation rows that share each widened block. Inlined
 * with a constant tile, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void row_tile(const float *x, int64_t k, const int8_t *wrow,
                                                           const float *wscale, int64_t blocks, float *out,
                                                           int64_t n, const int tile) {
    __m256 acc[ROW_TILE];
    for (int t = 0; t < tile; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256 wide[4];
        widen_block(wrow + b * QBLOCK, wide);
        const __m256 scale = _mm256_set1_ps(wscale[b]);
        for (int t = 0; t < tile; t++) acc[t] = _mm256_fmadd_ps(scale, block_dot(wide, x + t * k + b * QBLOCK), acc[t]);
    }
    for (int t = 0; t < tile; t++) out[t * n] = hsum(acc[t]);
}
#endif

/* out[m, n] = x[m, k] . w[n, k] for float activations x and an int8-block matrix w.
 * Every output is summed in the same order whatever the tile it was computed in. */
static void matmul_rows(const float *x, int64_t m, const int8_t *w, const float *ws, int64_t n, int64_t k,
                        float *out, int64_t row_begin, int64_t row_end) {
    const int64_t blocks = k / QBLOCK;
    for (int64_t j = row_begin; j < row_end; j++) {
        const int8_t *wrow = w + j * k;
        const float *wscale = ws + j * blocks;
#ifdef __AVX2__
        for (int64_t i0 = 0; i0 < m; i0 += ROW_TILE) {
            const float *xt = x + i0 * k;
            float *o = out + i0 * n + j;
            switch (m - i0 < ROW_TILE ? m - i0 : ROW_TILE) {
                case 1: row_tile(xt, k, wrow, wscale, blocks, o, n, 1); break;
                case 2: row_tile(xt, k, wrow, wscale, blocks, o, n, 2); break;
                case 3: row_tile(xt, k, wrow, wscale, blocks, o, n, 3); break;
                default: row_tile(xt, k, wrow, wscale, blocks, o, n, 4); break;
            }
        }
#else
        for (int64_t i = 0; i < m; i++) {
            const float *xrow = x + i * k;
            float total = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                float dot = 0.0f;
                for (int v = 0; v < QBLOCK; v++) dot += xrow[b * QBLOCK + v] * (float)wrow[b * QBLOCK + v];
                total += dot * wscale[b];
            }
            out[i * n + j] = total;
        }
#endif
    }
}

void llorch_q8_matmul(const float *x, int64_t m, const int8_t *w, const float *ws, int64_t n, int64_t k, float *out,
                      int threads) {
    const int64_t chunks = (n + ROW_CHUNK - 1) / ROW_CHUNK;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t begin = c * ROW_CHUNK;
        const int64_t end = begin + ROW_CHUNK < n ? begin + ROW_CHUNK : n;
        matmul_rows(x, m, w, ws, n, k, out, begin, end);
    }
    (void)threads;
}

/* Rows `ids` of a quantized matrix as floats: the embedding lookup. */
void llorch_q8_gather(const int8_t *w, const float *ws, int64_t k, const int64_t *ids, int64_t count, float *out) {
    const int64_t blocks = k / QBLOCK;
    for (int64_t r = 0; r < count; r++) {
        const int8_t *row = w + ids[r] * k;
        const float *scale = ws + ids[r] * blocks;
        for (int64_t i = 0; i < k; i++) out[r * k + i] = (float)row[i] * scale[i / QBLOCK];
    }
}

/* The whole matrix as floats, for prompt chunks: there a float GEMM beats int8 dots. */
void llorch_q8_dequantize(const int8_t *w, const float *ws, int64_t n, int64_t k, float *out, int threads) {
    const int64_t blocks = k / QBLOCK;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t j = 0; j < n; j++) {
        for (int64_t b = 0; b < blocks; b++) {
            const float scale = ws[j * blocks + b];
            const int8_t *src = w + j * k + b * QBLOCK;
            float *dst = out + j * k + b * QBLOCK;
            for (int v = 0; v < QBLOCK; v++) dst[v] = (float)src[v] * scale;
        }
    }
    (void)threads;
}

/* RMSNorm of `rows` contiguous rows of `dim` floats: x * w / sqrt(mean(x^2) + eps).
 * One call instead of five tensor ops: at decode sizes their dispatch is the cost. */
void llorch_rms_norm(const float *x, int64_t rows, int64_t dim, const float *w, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * dim;
        float squares = 0.0f;
        for (int64_t i = 0; i < dim; i++) squares += row[i] * row[i];
        const float inverse = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) out[r * dim + i] = row[i] * inverse * w[i];
    }
}
