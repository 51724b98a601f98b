/* The engine's per-row work over logits at vocabulary size: the greedy choice, a grammar's
 * mask, and a sampled token. In C because torch spends a pass (and an allocation) per
 * operation: drawing one token at 262k tokens took nine passes and 1.1 ms on one thread,
 * which is a tenth of a small model's decode step. */
#include <float.h>
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
static _Thread_local float *values_buf;
static _Thread_local int64_t scratch_cap;

static int reserve(int64_t n) {
    if (n <= scratch_cap) return 0;
    float *w = malloc((size_t)n * sizeof *w), *v = malloc((size_t)n * sizeof *v);
    int32_t *o = malloc((size_t)n * sizeof *o);
    if (!w || !o || !v) {
        free(w);
        free(o);
        free(v);
        return -1;
    }
    free(weights_buf);
    free(order_buf);
    free(values_buf);
    weights_buf = w;
    order_buf = o;
    values_buf = v;
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

#define SORTED_MAX 1024 /* candidates ranked by sorting them; more are selected in linear time */

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
    /* float lanes over 1024 values at a time, their sums in double: a lane's float sum over a whole
     * flat 262k row was 1e-5 off, and so was every draw's place in it */
    enum { CHUNK = 1024 };
    double total = 0.0;
    int64_t i = 0;
    for (; i + CHUNK <= n; i += CHUNK) total += lanes_mass(w + i, CHUNK / 16, least);
    total += lanes_mass(w + i, (n - i) / 16, least);
    for (i += (n - i) / 16 * 16; i < n; i++) total += w[i] >= least ? w[i] : 0.0f;
    return total;
}

/* How many of w[0..n) are at or above `least`, in sixteen lanes (as lanes_mass). */
static int64_t count_from(const float *w, int64_t n, float least) {
    int32_t lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += w[i + l] >= least;
    int64_t total = 0;
    for (int l = 0; l < 16; l++) total += lanes[l];
    for (; i < n; i++) total += w[i] >= least;
    return total;
}

/* Where the ranking of v[0..n) (descending) crosses `need`: the smallest value x for which what lies
 * above x (a count with by_count, else a mass) is below need; need > 0. */
typedef struct {
    float weight;  /* x */
    double above;  /* the count or mass of the values above x */
    int64_t ties;  /* how many values equal x */
} crossing;

/* A histogram of one radix level: the mass and the count of the values in each bucket. */
static _Thread_local double bucket_mass[4096];
static _Thread_local int64_t bucket_count[4096];

/* Selected by the bits of the values (which, at or above 0 and at most 1, order as the values do): in
 * three levels of buckets, bits 20-29, 8-19 and 0-7, each level one pass over the values of the
 * bucket the level before found the crossing in, those values then kept at the front of v. Why not
 * a quickselect: its comparisons go either way as often, and mispredicted they made it several times
 * slower than these passes, which have no branch to mispredict. */
static crossing crossing_of(float *v, int64_t n, double need, int by_count) {
    static const int shifts[3] = {20, 8, 0}, widths[3] = {1024, 4096, 256};
    double above = 0.0; /* the count or mass of the values above the current bucket */
    uint32_t found = 0; /* the crossing's bits, level by level */
    for (int level = 0; level < 3; level++) {
        const int shift = shifts[level];
        const uint32_t mask = (uint32_t)widths[level] - 1;
        memset(bucket_mass, 0, sizeof(double) * (size_t)widths[level]);
        memset(bucket_count, 0, sizeof(int64_t) * (size_t)widths[level]);
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits;
            memcpy(&bits, v + i, sizeof bits);
            bucket_mass[(bits >> shift) & mask] += v[i];
            bucket_count[(bits >> shift) & mask]++;
        }
        /* from the top: the first bucket whose values take what lies above them to need (or, when
         * rounding left the whole short of it, the lowest bucket with any value) */
        int64_t bucket = -1;
        double below = above;
        for (int64_t b = mask; b >= 0; b--) {
            if (bucket_count[b] == 0) continue;
            const double amount = by_count ? (double)bucket_count[b] : bucket_mass[b];
            bucket = b;
            above = below;
            if (below + amount >= need) break;
            below += amount;
        }
        found |= (uint32_t)bucket << shift;
        int64_t kept = 0;
        for (int64_t i = 0; i < n; i++) { /* without branches: a value's side is as likely as not */
            uint32_t bits;
            memcpy(&bits, v + i, sizeof bits);
            v[kept] = v[i];
            kept += ((bits >> shift) & mask) == (uint32_t)bucket;
        }
        n = kept;
    }
    crossing c;
    memcpy(&c.weight, &found, sizeof found);
    c.above = above;
    c.ties = n;
    return c;
}

/* The tokens at or above a floor, into order[0..return), ascending, and the floor (from *floor_w down,
 * 1e-4 of it at a time, or 0) where they are k tokens (k > 0) or, without top_k, enough of the mass for
 * top_p. A peaked row's first floor passes a handful: one pass with a branch seldom taken, their mass
 * summed as they come. Below it many may pass: the floor is found by vectorized sums, then they are
 * gathered without branches (a branch taken about as often as not is mispredicted half the time). */
static int64_t candidates_at_floor(const float *w, int64_t n, double total, int64_t k, float top_p, int32_t *order,
                                   float *floor_w) {
    int64_t count = 0;
    if (k == 0) {
        double mass = 0.0;
        for (int64_t j = 0; j < n; j++)
            if (w[j] >= *floor_w) {
                order[count++] = (int32_t)j;
                mass += w[j];
            }
        if (mass >= (double)top_p * total) return count;
        count = 0;
        *floor_w *= 1e-4f;
    }
    int64_t at_floor; /* how many weights are at or above the floor */
    for (;; *floor_w = *floor_w > 1e-30f ? *floor_w * 1e-4f : 0.0f) {
        if (*floor_w == 0.0f) {
            at_floor = n;
            break;
        }
        at_floor = count_from(w, n, *floor_w);
        if (k > 0 ? at_floor >= k : mass_from(w, n, *floor_w) >= (double)top_p * total) break;
    }
    if (at_floor * 8 < n) {
        for (int64_t j = 0; j < n; j++)
            if (w[j] >= *floor_w) order[count++] = (int32_t)j;
    } else {
        for (int64_t j = 0; j < n; j++) {
            order[count] = (int32_t)j;
            count += w[j] >= *floor_w;
        }
    }
    return count;
}

/* The tokens top_k and top_p keep, into order[0..return), ascending: the largest weights are
 * ranked among those at or above a floor, lowered until they hold the k tokens (or, without
 * top_k, enough of the mass for top_p), so a peaked row ranks a handful, not the vocabulary.
 * A ranking is ordered by descending weight, equal weights by ascending index. Why two ways to rank:
 * a flat row's candidates are most of the vocabulary, and sorting them all cost more than the step
 * (the default model at temperature 1.5 and top_p 0.95: 6.5 ms a token, Zen 4), where selecting the
 * crossing takes a few passes over them (0.65 ms); a handful are sorted faster. */
static int64_t ranked_kept(const float *w, int64_t n, double total, int64_t top_k, float top_p, int32_t *order) {
    const int by_k = top_k > 0 && top_k < n;
    const int64_t k = by_k ? top_k : n;
    float floor_w = 1e-3f;
    int64_t count = candidates_at_floor(w, n, total, by_k ? k : 0, top_p, order, &floor_w);
    if (count > SORTED_MAX) {
        float *v = values_buf; /* the candidates' weights, to select among */
        const int64_t candidates = count;
        for (int64_t j = 0; j < count; j++) v[j] = w[order[j]];
        crossing c = {floor_w, 0.0, -1}; /* every candidate: those at or above the floor */
        double in_set = total;
        /* top_k: every weight at or above the k-th largest (ties with it stay) */
        if (by_k && count > k) {
            c = crossing_of(v, count, (double)k, 1);
            in_set = 0.0;
            int64_t kept = 0;
            for (int64_t j = 0; j < count; j++) { /* crossing_of kept only its last bucket's values in v */
                const float x = w[order[j]];
                if (x >= c.weight) {
                    in_set += x;
                    v[kept++] = x;
                }
            }
            count = kept;
            c.ties = -1; /* all of the k-th's equals */
        }
        /* top_p: the smallest prefix of the ranking whose mass reaches top_p, and always the first */
        if (top_p < 1.0f) {
            const double need = (double)top_p * in_set;
            c = crossing_of(v, count, need > 0.0 ? need : DBL_MIN, 0);
            double before = c.above;
            int64_t taken = 0;
            while (taken < c.ties && (before < need || (taken == 0 && c.above == 0.0))) {
                before += c.weight;
                taken++;
            }
            c.ties = taken;
        }
        /* in ascending order: each candidate above the crossing, and its first c.ties equal ones (-1: all) */
        const int64_t tie_limit = c.ties < 0 ? candidates : c.ties;
        int64_t kept = 0, ties = 0;
        for (int64_t j = 0; j < candidates; j++) { /* without branches, as crossing_of's */
            const float x = w[order[j]];
            const int64_t tie = x == c.weight;
            order[kept] = order[j];
            kept += (int64_t)(x > c.weight) | (tie & (int64_t)(ties < tie_limit));
            ties += tie;
        }
        return kept;
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

/* Why the rows at once, on the step's threads: a sampled row is a few passes over its vocabulary (0.2
 * ms at 262k), and a batch's rows one after another on one thread, while the step's other threads
 * waited, were most of the engine's time a step at 16 streams. Each thread's scratch is its own. */
void llorch_sample_rows(const float *x, int64_t n, const int64_t *rows, int64_t count, const float *temperature,
                        const int64_t *top_k, const float *top_p, const float *min_p, const double *uniform,
                        int64_t *out, int threads) {
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
#endif
    for (int64_t i = 0; i < count; i++)
        out[i] = llorch_sample_row(x + rows[i] * n, n, temperature[i], top_k[i], top_p[i], min_p[i], uniform[i]);
}
