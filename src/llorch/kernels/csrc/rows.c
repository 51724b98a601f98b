/* The engine's per-row work over logits at vocabulary size: the greedy choice, a grammar's
 * mask, and a sampled token. In C because torch spends a pass (and an allocation) per
 * operation: drawing one token at 262k tokens took nine passes and 1.1 ms on one thread,
 * which is a tenth of a small model's decode step. */
#include <math.h>
#include <stdlib.h>

#include "llorch.h"
#include "vmath.h"

/* The largest value of a row, or NaN when the row holds one. */
static float row_max(const float *row, int64_t cols) {
    float best = row[0];
    int nan = row[0] != row[0];
    int64_t i = 1;
#if defined(__AVX512F__)
    __m512 high = _mm512_set1_ps(best);
    __mmask16 unordered = 0;
    for (; i + 16 <= cols; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        high = _mm512_max_ps(high, v);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    best = _mm512_reduce_max_ps(high);
    nan |= unordered != 0;
#elif defined(LLORCH_AVX2)
    __m256 high = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
    for (; i + 8 <= cols; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        high = _mm256_max_ps(high, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, high);
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    nan |= _mm256_movemask_ps(unordered) != 0;
#endif
    for (; i < cols; i++) {
        best = row[i] > best ? row[i] : best;
        nan |= row[i] != row[i];
    }
    return nan ? NAN : best;
}

/* The first index of a row where it is `best` or a NaN (cols when there is none). Why vectors: the
 * greedy token lies anywhere in a 262k vocabulary, and scanning up to it one value at a time took
 * half the argmax. Measured (262144 columns, in cache, Zen 4): one row 45 -> 23 us, 32 rows 4.2 ->
 * 1.4 ms. (One pass keeping each lane's first largest value's index was slower: its chain of
 * compare and blend is longer than max's.) */
static int64_t first_of(const float *row, int64_t cols, float best) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(best);
    for (; j + 16 <= cols; j += 16) {
        const __m512 v = _mm512_loadu_ps(row + j);
        const __mmask16 hit = _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        if (hit) return j + __builtin_ctz(hit);
    }
#elif defined(LLORCH_AVX2)
    const __m256 target = _mm256_set1_ps(best);
    for (; j + 8 <= cols; j += 8) {
        const __m256 v = _mm256_loadu_ps(row + j);
        const int hit = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v, target, _CMP_EQ_OQ),
                                                        _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        if (hit) return j + __builtin_ctz(hit);
    }
#endif
    for (; j < cols; j++)
        if (row[j] == best || row[j] != row[j]) return j;
    return cols;
}

int64_t llorch_argmax_span(const float *x, int64_t n, float *max) {
    *max = row_max(x, n);
    const int64_t j = first_of(x, n, *max);
    /* -1 when the span holds a NaN: its max is then NaN, which no value equals, and the scan stops at
     * the first NaN */
    return j < n && x[j] == x[j] ? j : -1;
}

void llorch_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
    float max;
    for (int64_t r = 0; r < rows; r++) out[r] = llorch_argmax_span(x + r * cols, cols, &max);
}
void llorch_mask_row(float *x, int64_t cols, const uint32_t *allowed, int64_t words) {
    const float none = -INFINITY;
    for (int64_t w = 0; w < words && 32 * w < cols; w++) {
        uint32_t bits = allowed[w];
        if (bits == 0xFFFFFFFFu) continue; /* the common case in free text: nothing to do */
        int64_t end = 32 * w + 32 < cols ? 32 * w + 32 : cols;
        for (int64_t j = 32 * w; j < end; j++, bits >>= 1)
            if (!(bits & 1u)) x[j] = none;
    }
    for (int64_t j = 32 * words; j < cols; j++) x[j] = none;
}


/* A row's scratch, grown as needed and kept: one per thread, so concurrent callers never share. */
static _Thread_local float *weights_buf;
static _Thread_local int32_t *order_buf;
static _Thread_local int64_t scratch_cap;

static int reserve(int64_t n) {
    if (n <= scratch_cap) return 0;
    float *w = malloc((size_t)n * sizeof *w);
    int32_t *o = malloc((size_t)n * sizeof *o);
    if (!w || !o) {
        free(w);
        free(o);
        return -1;
    }
    free(weights_buf);
    free(order_buf);
    weights_buf = w;
    order_buf = o;
    scratch_cap = n;
    return 0;
}

static _Thread_local const float *sort_weights; /* qsort passes no context: the weights being ranked */

static int by_weight_descending(const void *a, const void *b) {
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (sort_weights[i] != sort_weights[j]) return sort_weights[i] > sort_weights[j] ? -1 : 1;
    return i - j;
}

static int by_index(const void *a, const void *b) { return *(const int32_t *)a - *(const int32_t *)b; }

/* The tokens top_k and top_p keep, into order[0..return), ascending: the largest weights are
 * ranked among those at or above a floor, lowered until they hold the k tokens (or, without
 * top_k, enough of the mass for top_p), so a peaked row sorts a handful, not the vocabulary. */
static int64_t ranked_kept(const float *w, int64_t n, double total, int64_t top_k, float top_p, int32_t *order) {
    const int by_k = top_k > 0 && top_k < n;
    const int64_t k = by_k ? top_k : n;
    int64_t count = 0;
    for (float floor_w = 1e-3f;; floor_w = floor_w > 1e-30f ? floor_w * 1e-4f : 0.0f) {
        double mass = 0.0;
        count = 0;
        for (int64_t j = 0; j < n; j++)
            if (w[j] >= floor_w) {
                order[count++] = (int32_t)j;
                mass += w[j];
            }
        if (floor_w == 0.0f || (by_k ? count >= k : mass >= (double)top_p * total)) break;
    }
    sort_weights = w;
    qsort(order, (size_t)count, sizeof *order, by_weight_descending);
    int64_t kept = count < k ? count : k;
    while (kept < count && w[order[kept]] == w[order[kept - 1]]) kept++; /* ties with the k-th stay */
    if (top_p < 1.0f) {
        double in_set = 0.0; /* the softmax runs over the top-k tokens only */
        if (by_k) {
            for (int64_t j = 0; j < kept; j++) in_set += w[order[j]];
        } else {
            in_set = total;
        }
        /* keep the smallest prefix whose mass reaches top_p, and always the first */
        double before = 0.0;
        int64_t prefix = 0;
        while (prefix < kept && (prefix == 0 || before < (double)top_p * in_set)) before += w[order[prefix++]];
        kept = prefix;
    }
    qsort(order, (size_t)kept, sizeof *order, by_index);
    return kept;
}

/* The sum of the weights at or above `least` among w[0..16 * groups), in sixteen float lanes (a
 * plain sum would not vectorize: C keeps the order of a scalar float sum). */
static double lanes_mass(const float *w, int64_t groups, float least) {
    float lanes[16] = {0};
    for (int64_t i = 0; i < 16 * groups; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += w[i + l] >= least ? w[i + l] : 0.0f;
    double total = 0.0;
    for (int l = 0; l < 16; l++) total += lanes[l];
    return total;
}

/* The same over w[0..n). */
static double mass_from(const float *w, int64_t n, float least) {
    double total = lanes_mass(w, n / 16, least);
    for (int64_t i = n / 16 * 16; i < n; i++) total += w[i] >= least ? w[i] : 0.0f;
    return total;
}

#define DRAW_BLOCK 64 /* weights skipped at once while their sum stays below the target */

/* The first index, in order, at which the cumulative weight (of weights at or above `least`)
 * passes `target`; the last such index when rounding leaves the target just out of reach. */
static int64_t first_past(const float *w, int64_t n, float least, double target) {
    double cumulative = 0.0;
    int64_t last = -1;
    for (int64_t start = 0; start < n; start += DRAW_BLOCK) {
        const int64_t end = start + DRAW_BLOCK < n ? start + DRAW_BLOCK : n;
        if (end - start == DRAW_BLOCK) {
            const double block = lanes_mass(w + start, DRAW_BLOCK / 16, least);
            if (cumulative + block <= target * (1.0 - 1e-6)) { /* clearly short of it: skip the block */
                cumulative += block;
                for (int64_t j = end - 1; j >= start; j--)
                    if (w[j] >= least) {
                        last = j;
                        break;
                    }
                continue;
            }
        }
        for (int64_t j = start; j < end; j++) {
            if (w[j] < least) continue;
            cumulative += w[j];
            last = j;
            if (cumulative > target) return j;
        }
    }
    return last;
}

int64_t llorch_sample_row(const float *x, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                          double uniform) {
    if (n <= 0 || reserve(n) != 0) return -1;
    float *w = weights_buf;
    const float high = row_max(x, n);
    if (isnan(high) || isinf(high)) return -1; /* the caller decides such a row */
    /* w = e^((x - max) / T), the softmax's numerators: the largest is exactly 1 */
    for (int64_t i = 0; i < n; i++) w[i] = v_exp((x[i] - high) / temperature);
    const double total = mass_from(w, n, 0.0f); /* at least 1 and at most n: every weight is in [0, 1] */
    /* min_p drops weights below min_p times the largest, which is 1 */
    if (!((top_k > 0 && top_k < n) || top_p < 1.0f))
        return first_past(w, n, min_p, (min_p > 0.0f ? mass_from(w, n, min_p) : total) * uniform);
    const int32_t *order = order_buf;
    const int64_t kept = ranked_kept(w, n, total, top_k, top_p, order_buf);
    double mass = 0.0;
    for (int64_t j = 0; j < kept; j++) mass += w[order[j]] >= min_p ? w[order[j]] : 0.0;
    const double target = mass * uniform;
    double cumulative = 0.0;
    int64_t last = -1;
    for (int64_t j = 0; j < kept; j++) {
        if (w[order[j]] < min_p) continue;
        cumulative += w[order[j]];
        last = order[j];
        if (cumulative > target) return last;
    }
    return last;
}
