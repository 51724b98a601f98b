/* Attention of one row's query heads over one chunk of its cached positions: the decoder
 * step's work item (decoder.c), for the `group` query heads that share one KV head.
 *
 * The cache holds keys and values as float16 (half the bytes of float32, which is what this
 * reads most of); each is widened to float32 as it is loaded, and all arithmetic is float32.
 * Measured in the step (two threads, Zen 4, alternating runs), attention of 32 rows at 64
 * positions: the 1.1B file 7.9-9.4 -> 6.2 ms, the 3B file 34.1 -> 25.5 ms; of one row at 512
 * positions: 2.05 -> 1.59 ms and 7.6 -> 6.1 ms. Writing the cache costs less too (half the
 * fresh pages to touch): the 3B file's 32-row step 412 -> 394 ms in all.
 *
 * Why this is more than three loops: in decode, attention reads each cached key and value
 * once per head, and at a few hundred positions it took 14% of a 1.1B model's step, most of
 * it in reducing each (position, head) dot product on its own and in adding to accumulators
 * kept in memory. With AVX-512, sixteen dot products are reduced together and the weighted
 * values are summed in registers. Both give the same bits as the plain loops (every sum is
 * formed in the same order), so a row's result never depends on the build's path choice
 * beyond the instruction set, as before.
 */
#include <math.h>

#include "simd.h"
#include "vmath.h"

#define MAX_GROUP 64 /* query heads per KV head whose softmax runs side by side */
#define AHEAD 8      /* positions whose keys or values are asked for before they are read */

/* A work item's keys and values, asked for into L2: the next item's a share at a time (ahead_to) while this
 * item's scores are computed, or this item's own all at once. */
typedef struct {
    const uint16_t *keys, *values;
    const int64_t *slots;
    int64_t stride, offset, head_dim, count, done;
    uint64_t share; /* positions asked for per unit of this item's scores, in 32.32 fixed point */
} ahead;

/* Ask for the next item's positions up to `upto` (of its count). */
static inline void ahead_to(ahead *a, int64_t upto) {
    for (; a->done < upto; a->done++) {
        const int64_t at = a->slots[a->done] * a->stride + a->offset;
        for (int64_t i = 0; i < a->head_dim; i += 32) {
            __builtin_prefetch(a->keys + at + i, 0, 2);
            __builtin_prefetch(a->values + at + i, 0, 2);
        }
    }
}

/* As far as the next item's asking goes after `done` units of this item's scores: a product, not a division,
 * for it runs once every sixteen (eight) units. */
static inline void ahead_share(ahead *a, int64_t done) { ahead_to(a, (int64_t)(((uint64_t)done * a->share) >> 32)); }

#if defined(__AVX512F__)
/* Sixteen float16 values at p, as floats. */
static inline __m512 load16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* Sixteen vectors reduced to their sums, lane i of the result holding sum(v[i]), each sum
 * paired exactly as _mm512_reduce_add_ps pairs it: lane l with l + 8, then l with l + 4, then
 * l with l + 2, then l with l + 1. The pairs of vectors are merged in the same steps. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 halves[8], quarters[4], eighths[2];
    for (int i = 0; i < 8; i++) {  /* lanes 0-7: v[2i]'s l + (l + 8); lanes 8-15: v[2i + 1]'s */
        const __m512 a = v[2 * i], b = v[2 * i + 1];
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int i = 0; i < 4; i++) {  /* 128-bit lane j: vector 4i + j's sums of l and l + 4 */
        const __m512 a = halves[2 * i], b = halves[2 * i + 1];
        quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    for (int i = 0; i < 2; i++) {  /* 128-bit lane j: {vector 4(2i) + j: l0 + l2, l1 + l3; vector 4(2i+1) + j: ...} */
        const __m512 a = quarters[2 * i], b = quarters[2 * i + 1];
        eighths[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    /* 128-bit lane j: the sums of vectors j, 4 + j, 8 + j, 12 + j */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, sums);
}

/* scores[u] = scale * q_{u % group} . key_{u / group} for the sixteen units u0 .. u0 + 15.
 * `heads` query heads times `positions` keys, heads * positions = 16: when the group divides
 * sixteen (positions = 16 / group) or sixteen divides it (one key, sixteen of its heads), each
 * query slice and each key slice is loaded once and used by every unit that needs it; with
 * heads = 0 (any other group) each unit loads its own. The products and their order are the
 * same in every case, so are the bits. */
static inline __attribute__((always_inline)) void score16(const float *q, const uint16_t *const *key_of, int64_t count,
                                                         int64_t group, int64_t head_dim, float scale, int64_t u0,
                                                         float *scores, const int heads) {
    for (int64_t p = u0 / group + AHEAD; p <= (u0 + 15) / group + AHEAD && p < count; p++)
        prefetch_halves(key_of[p], head_dim);
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    if (heads) {
        const int positions = 16 / heads;
        const float *qs[16];
        const uint16_t *ks[16];
        for (int h = 0; h < heads; h++) qs[h] = q + (u0 % group + h) * head_dim;
        for (int p = 0; p < positions; p++) ks[p] = key_of[u0 / group + p];
        for (int64_t d = 0; d < head_dim; d += 16) {
            __m512 qv[16], kv[16];
            for (int h = 0; h < heads; h++) qv[h] = _mm512_loadu_ps(qs[h] + d);
            for (int p = 0; p < positions; p++) kv[p] = load16(ks[p] + d);
            for (int p = 0; p < positions; p++)
                for (int h = 0; h < heads; h++) acc[p * heads + h] = _mm512_fmadd_ps(qv[h], kv[p], acc[p * heads + h]);
        }
    } else {
        const float *qs[16];
        const uint16_t *ks[16];
        for (int i = 0; i < 16; i++) {
            qs[i] = q + ((u0 + i) % group) * head_dim;
            ks[i] = key_of[(u0 + i) / group];
        }
        for (int64_t d = 0; d < head_dim; d += 16)
            for (int i = 0; i < 16; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qs[i] + d), load16(ks[i] + d), acc[i]);
    }
    _mm512_storeu_ps(scores + u0, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
}

/* score16 for a group of three (as Llama 3.2 3B's 24 query heads over 8 KV heads): sixteen units
 * start at head `first` of their first key and span six keys, so its three query slices and six
 * key slices are each loaded once (the generic path loads sixteen of each). Same products, same
 * order, same bits. With the softmax's vectorized exponentials below, measured in llorch_attend_chunk. */
static inline __attribute__((always_inline)) void score16_of3(const float *q, const uint16_t *const *key_of,
                                                             int64_t count, int64_t head_dim, float scale, int64_t u0,
                                                             float *scores, const int first) {
    for (int64_t p = u0 / 3 + AHEAD; p <= (u0 + 15) / 3 + AHEAD && p < count; p++) prefetch_halves(key_of[p], head_dim);
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const uint16_t *ks[6];
    for (int p = 0; p < 6; p++) ks[p] = key_of[u0 / 3 + p];  /* unit u0 + 15's key is u0 / 3 + 5 whatever `first` */
    for (int64_t d = 0; d < head_dim; d += 16) {
        __m512 qv[3], kv[6];
        for (int h = 0; h < 3; h++) qv[h] = _mm512_loadu_ps(q + h * head_dim + d);
        for (int p = 0; p < 6; p++) kv[p] = load16(ks[p] + d);
        for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(qv[(first + i) % 3], kv[(first + i) / 3], acc[i]);
    }
    _mm512_storeu_ps(scores + u0, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
}

static inline __attribute__((always_inline)) void score_all16(const float *q, const uint16_t *const *key_of,
                                                             int64_t count, int64_t group, int64_t head_dim,
                                                             float scale, int64_t units, float *scores, ahead *next) {
#define SCORE_AT(heads, dim) for (int64_t u = 0; u + 16 <= units; u += 16) { \
                         score16(q, key_of, count, group, dim, scale, u, scores, heads); \
                         ahead_share(next, u + 16); \
                     }
    /* The common head sizes as constants: each query slice then lies at a fixed offset from q, where with the size
     * a variable the eight query pointers of a group of eight outran the registers and were read back from the
     * stack at every product. This function inlined into its one caller: left out of line once it grew, the
     * shapes that keep the variable lost 4-5%. Measured per work item of 128 positions (in cache, one thread,
     * Zen 5, the builds in turn in one process, same bits; the same library against itself within 0.5%): eight
     * heads of 64 4.49 -> 4.01 us, eight of 128 7.36 -> 6.23, one of 128 2.51 -> 2.30, one of 64 4.31 -> 4.23,
     * twelve of 64 7.61 -> 7.40, four of 80 5.80 -> 5.69. Sixteen streams of the 1.1B file at 2048 positions
     * (two threads, bench/step_profile.py, in turn, twice): attention 37.3 / 38.7 -> 32.7 / 35.6 ms a step,
     * 206-210 -> 211-222 tok/s. A lone head of 64 (sixteen keys a pass) keeps the variable: as a constant it
     * ran 0.69x. */
#define SCORE(heads) do { \
        if (head_dim == 64 && (heads) >= 2) { SCORE_AT(heads, 64) } \
        else if (head_dim == 128 && (heads) >= 1) { SCORE_AT(heads, 128) } \
        else { SCORE_AT(heads, head_dim) } \
    } while (0)
    switch (group) {
        case 1: SCORE(1); break;
        case 2: SCORE(2); break;
        case 3:
            for (int64_t u = 0; u + 16 <= units; u += 16) {
                switch (u % 3) {  /* the head unit u starts at: a constant in each copy */
                    case 0: score16_of3(q, key_of, count, head_dim, scale, u, scores, 0); break;
                    case 1: score16_of3(q, key_of, count, head_dim, scale, u, scores, 1); break;
                    default: score16_of3(q, key_of, count, head_dim, scale, u, scores, 2);
                }
                ahead_share(next, u + 16);
            }
            break;
        case 4: SCORE(4); break;
        case 8: SCORE(8); break;
        default:
            if (group % 16 == 0) {
                SCORE(16);
            } else {
                SCORE(0);
            }
    }
#undef SCORE
#undef SCORE_AT
}

/* Weighted values of eight 16-value slices (unit u: head u / slices, slice u % slices), summed
 * over the chunk's positions in order, in registers. `heads` heads of 8 / heads slices each
 * when a head's slices divide eight or eight divide them: each weight is broadcast and each
 * value slice loaded once per position (0: every unit on its own). Same bits either way. */
static inline __attribute__((always_inline)) void weigh8(const float *scores, const uint16_t *const *value_of,
                                                        int64_t count, int64_t group, int64_t head_dim, int64_t u0,
                                                        float *part, const int heads) {
    const int64_t slices = head_dim / 16;
    __m512 acc[8];
    const float *weights[8];
    int64_t offset[8];
    for (int i = 0; i < 8; i++) {
        acc[i] = _mm512_setzero_ps();
        weights[i] = scores + (u0 + i) / slices;
        offset[i] = 16 * ((u0 + i) % slices);
    }
    const int per_head = heads ? 8 / heads : 1;
    for (int64_t p = 0; p < count; p++) {
        if (u0 == 0 && p + AHEAD < count) prefetch_halves(value_of[p + AHEAD], head_dim);  /* the first pass */
        const uint16_t *value = value_of[p];
        if (heads) {
            __m512 w[8], v[8];
            for (int h = 0; h < heads; h++) w[h] = _mm512_set1_ps(weights[h * per_head][p * group]);
            for (int s = 0; s < per_head; s++) v[s] = load16(value + offset[s]);
            for (int h = 0; h < heads; h++)
                for (int s = 0; s < per_head; s++)
                    acc[h * per_head + s] = _mm512_add_ps(acc[h * per_head + s], _mm512_mul_ps(w[h], v[s]));
        } else {
            for (int i = 0; i < 8; i++)
                acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_set1_ps(weights[i][p * group]),
                                                             load16(value + offset[i])));
        }
    }
    for (int i = 0; i < 8; i++)
        _mm512_storeu_ps(part + (weights[i] - scores) * (head_dim + 2) + 2 + offset[i], acc[i]);
}

/* Weighted values of HEADS x SLICES units (HEADS * SLICES = 16): heads h0.. of slices s0.., summed
 * over the chunk's positions in order, in registers. Each value slice is loaded once per position
 * for all the heads that share it (weigh8 loads it once per head when a head has eight slices or
 * more, the default model's 256-wide heads, say). Each unit's additions are weigh8's, in its order:
 * same bits. */
static inline __attribute__((always_inline)) void weigh_shared(const float *scores, const uint16_t *const *value_of,
                                                              int64_t count, int64_t group, int64_t head_dim, int64_t h0,
                                                              int64_t s0, float *part, const int heads) {
    const int slices = 16 / heads;
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < count; p++) {
        if (h0 == 0 && s0 == 0 && p + AHEAD < count) prefetch_halves(value_of[p + AHEAD], head_dim);  /* first pass */
        const uint16_t *value = value_of[p] + 16 * s0;
        __m512 w[16], v[16];
        for (int h = 0; h < heads; h++) w[h] = _mm512_set1_ps(scores[p * group + h0 + h]);
        for (int s = 0; s < slices; s++) v[s] = load16(value + 16 * s);
        for (int h = 0; h < heads; h++)
            for (int s = 0; s < slices; s++)
                acc[h * slices + s] = _mm512_add_ps(acc[h * slices + s], _mm512_mul_ps(w[h], v[s]));
    }
    for (int h = 0; h < heads; h++)
        for (int s = 0; s < slices; s++)
            _mm512_storeu_ps(part + (h0 + h) * (head_dim + 2) + 2 + 16 * (s0 + s), acc[h * slices + s]);
}

/* Every whole group of eight units; returns how many units that was. */
static int64_t weigh_all8(const float *scores, const uint16_t *const *value_of, int64_t count, int64_t group,
                          int64_t head_dim, float *part) {
    const int64_t slices = head_dim / 16, units = group * slices / 8 * 8;
#define WEIGH(heads) for (int64_t v = 0; v < units; v += 8) \
                         weigh8(scores, value_of, count, group, head_dim, v, part, heads)
#define SHARED(heads) for (int64_t h0 = 0; h0 < group; h0 += heads) \
                          for (int64_t s0 = 0; s0 < slices; s0 += 16 / heads) \
                              weigh_shared(scores, value_of, count, group, head_dim, h0, s0, part, heads)
    /* Heads sharing each value slice where they can. Measured on prefill of 512 tokens (Xeon, two
     * threads, alternating in one process, same bits): the default model (four heads of 256) 1760 ->
     * 1860 tok/s, the 1.1B file (eight heads of 64, before two at a time) 274 -> 278. */
    if (slices % 4 == 0 && group % 4 == 0) {
        SHARED(4);
        return group * slices;
    }
    if (slices % 8 == 0 && group % 2 == 0) {
        SHARED(2);
        return group * slices;
    }
#undef SHARED
    if (slices % 8 == 0) {
        WEIGH(1);
    } else if (slices == 4) {
        WEIGH(2);
    } else if (slices == 2) {
        WEIGH(4);
    } else if (slices == 1) {
        WEIGH(8);
    } else {
        WEIGH(0);
    }
#undef WEIGH
    return units;
}
#endif

#if defined(LLORCH_AVX2) && !defined(__AVX512F__)
/* Eight vectors reduced to their sums, lane i of the result holding sum(v[i]), each sum paired as
 * hsum8 pairs it (dot_f32_f16's reduction): l with l + 4, then l with l + 2, then l with l + 1. */
static inline __m256 reduce8(const __m256 v[8]) {
    __m256 halves[4], quarters[2];
    for (int i = 0; i < 4; i++) /* 128-bit half 0: v[2i]'s l + (l + 4); half 1: v[2i + 1]'s */
        halves[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                                  _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* per half: (0 + 2), (1 + 3) of halves[2i], then of halves[2i + 1] */
        quarters[i] = _mm256_add_ps(_mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* half 0: the sums of v[0], v[2], v[4], v[6]; half 1: of v[1], v[3], v[5], v[7] */
    const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(quarters[0], quarters[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm256_shuffle_ps(quarters[0], quarters[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* scores[u] = scale * q_{u % group} . key_{u / group} for the eight units u0 .. u0 + 7: dot_f32_f16's
 * products, order and reduction, eight at once (its sums reduced together, not each on its own).
 * With v_exp8 for the weights (the compiler left that loop value by value on AVX2), measured on the
 * avx2 variant (Xeon, two threads, alternating in one process, same bits): prefill of 512 tokens, the
 * 1.1B file 103 -> 111 tok/s, the default model 660 -> 699. */
static inline void score8(const float *q, const uint16_t *const *key_of, int64_t group, int64_t head_dim, float scale,
                          int64_t u0, float *scores) {
    const float *qs[8];
    const uint16_t *ks[8];
    for (int i = 0; i < 8; i++) {
        qs[i] = q + ((u0 + i) % group) * head_dim;
        ks[i] = key_of[(u0 + i) / group];
    }
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    const int one_key = ks[0] == ks[7]; /* eight heads of one key: it is widened once */
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 key = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks[0] + d)));
        for (int i = 0; i < 8; i++) {
            if (i > 0 && !one_key) key = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks[i] + d)));
            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[i] + d), key, acc[i]);
        }
    }
    _mm256_storeu_ps(scores + u0, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
}

/* The first n of v held in registers: an empty asm that takes each. */
static inline __attribute__((always_inline)) void hold8(__m256 v[8], int n) {
    for (int i = 0; i < n; i++) __asm__("" : "+x"(v[i]));
}

/* score8 where its eight units share query and key slices: `heads` heads of 8 / heads keys from key p0 (a group
 * of 1, 2 or 4: every head of each key), or eight heads of one key from head h0 (a group that eight divides),
 * into out;
 * each query slice and each key is loaded once a step for every unit that needs it. The same products in the
 * same order, reduced by reduce8: score8's bits. Why: score8 keeps eight query and eight key pointers, which
 * with its accumulators outran the registers, so each step read them back from the stack, and it asked per
 * step whether the eight units shared a key; with the head size a constant (64, 128) each query slice lies
 * at a fixed offset from one pointer. Measured below (score_all8). */
static inline __attribute__((always_inline)) void score8_shared(const float *q, const uint16_t *const *key_of,
                                                               int64_t p0, int64_t h0, int64_t head_dim, float scale,
                                                               float *out, const int heads) {
    const int positions = 8 / heads;
    const float *qs = q + h0 * head_dim;
    const uint16_t *ks[8];
    for (int p = 0; p < positions; p++) ks[p] = key_of[p0 + p];
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 qv[8];
        for (int h = 0; h < heads; h++) qv[h] = _mm256_loadu_ps(qs + h * head_dim + d);
        /* fewer than eight heads: each query slice in a register for all its keys. The compiler read it again for
         * each key; held, four heads of 256 (the default model) 12.0 -> 9.6-10.2 us a work item, four of 128
         * 6.3 -> 5.5-5.7 (measured as score_all8 says) */
        if (heads < 8) hold8(qv, heads);
        for (int p = 0; p < positions; p++) {
            const __m256 key = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks[p] + d)));
            for (int h = 0; h < heads; h++) acc[p * heads + h] = _mm256_fmadd_ps(qv[h], key, acc[p * heads + h]);
        }
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
}

/* score8 for a group of three (Llama 3.2 3B's 24 query heads over 8 KV heads): eight units from head `first` of
 * key p0 span up to four keys, each widened once a step, and the three query slices. score8's bits. */
static inline __attribute__((always_inline)) void score8_of3(const float *q, const uint16_t *const *key_of, int64_t p0,
                                                            int64_t head_dim, float scale, float *out, const int first) {
    const int keys = (first + 7) / 3 + 1;
    const uint16_t *ks[4];
    for (int p = 0; p < keys; p++) ks[p] = key_of[p0 + p];
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 kv[4];
        for (int p = 0; p < keys; p++) kv[p] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks[p] + d)));
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + ((first + i) % 3) * head_dim + d), kv[(first + i) / 3], acc[i]);
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
}

/* Every whole eight of a chunk's units (scores[p * group + h]) through score8_shared or score8_of3 where the group
 * allows, else score8, asking for the next item's keys and values as it goes; returns how many units that was.
 * The units are walked by key and head, not divided out of their index: score8 divided twice a unit. Measured
 * per work item of 128 positions, the next item asked for as the step asks (in cache, one thread, Zen 3, the
 * builds in turn, the same bits in 1050 shapes), with ahead_share's product for its division: eight heads of 64
 * (the 1.1B file) 10.7 -> 8.4 us, three of 128 (the 3B) 11.7 -> 7.7, four of 128 13.3 -> 8.5, one of 128 4.8 ->
 * 3.6, sixteen of 64 23.8 -> 17.1. */
static inline __attribute__((always_inline)) int64_t score_all8(const float *q, const uint16_t *const *key_of,
                                                               int64_t count, int64_t group, int64_t head_dim,
                                                               float scale, float *scores, ahead *next) {
    const int64_t units = count * group, whole = units / 8 * 8;
#define SHARED_AT(heads, dim) do { \
        if ((heads) == 8) { \
            for (int64_t p = 0; p < count; p++) { \
                for (int64_t h0 = 0; h0 < group; h0 += 8) \
                    score8_shared(q, key_of, p, h0, dim, scale, scores + p * group + h0, 8); \
                ahead_share(next, (p + 1) * group); \
            } \
        } else { \
            for (int64_t p = 0; p + 8 / (heads) <= count; p += 8 / (heads)) { \
                score8_shared(q, key_of, p, 0, dim, scale, scores + p * (heads), heads); \
                ahead_share(next, (p + 8 / (heads)) * (heads)); \
            } \
        } \
    } while (0)
#define SHARED(heads) do { \
        if (head_dim == 64) SHARED_AT(heads, 64); \
        else if (head_dim == 128) SHARED_AT(heads, 128); \
        else SHARED_AT(heads, head_dim); \
    } while (0)
    switch (group) {
        case 1: SHARED(1); return whole;
        case 2: SHARED(2); return whole;
        case 4: SHARED(4); return whole;
        case 3:
            for (int64_t u = 0, p = 0; u + 8 <= units; u += 8, p = u / 3) {
                switch (u % 3) { /* the head unit u starts at: a constant in each copy */
                    case 0: score8_of3(q, key_of, p, head_dim, scale, scores + u, 0); break;
                    case 1: score8_of3(q, key_of, p, head_dim, scale, scores + u, 1); break;
                    default: score8_of3(q, key_of, p, head_dim, scale, scores + u, 2);
                }
                ahead_share(next, u + 8);
            }
            return whole;
        default:
            if (group % 8 == 0) {
                SHARED(8);
                return whole;
            }
    }
#undef SHARED
#undef SHARED_AT
    for (int64_t u = 0; u < whole; u += 8) {
        score8(q, key_of, group, head_dim, scale, u, scores);
        ahead_share(next, u + 8);
    }
    return whole;
}

/* weigh_shared at AVX2's width. Weighted values of HEADS x SLICES units (eight values a slice, HEADS * SLICES =
 * 8): heads h0.. of slices s0.., summed over the chunk's positions in order, in registers, each value slice loaded
 * and widened once a position for all the heads that share it (weigh_slices8 widens it once per head). Each unit's
 * operations are weigh_slices8's (a product, then a sum), in its order: same bits. Measured per work item of 128
 * positions (in cache, one thread, Zen 5, the builds in turn in one process): eight heads of 64 6.59 -> 5.78 us,
 * four of 128 7.40 -> 6.75, four of 256 12.61 -> 11.10, eight of 128 10.57 -> 8.96, two of 128 4.52 -> 4.12;
 * sixteen streams of the 1.1B file at 2048 positions (two threads, bench/step_profile.py, in turn, twice):
 * attention 65.5 / 65.8 -> 60.7 / 59.4 ms a step. */
static inline __attribute__((always_inline)) void weigh_shared8(const float *scores, const uint16_t *const *value_of,
                                                               int64_t count, int64_t group, int64_t head_dim,
                                                               int64_t h0, int64_t s0, float *part, const int heads) {
    const int slices = 8 / heads;
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t p = 0; p < count; p++) {
        const uint16_t *value = value_of[p] + 8 * s0;
        __m256 w[8], v[8];
        for (int h = 0; h < heads; h++) w[h] = _mm256_set1_ps(scores[p * group + h0 + h]);
        for (int s = 0; s < slices; s++) v[s] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(value + 8 * s)));
        for (int h = 0; h < heads; h++)
            for (int s = 0; s < slices; s++)
                acc[h * slices + s] = _mm256_add_ps(acc[h * slices + s], _mm256_mul_ps(w[h], v[s]));
    }
    for (int h = 0; h < heads; h++)
        for (int s = 0; s < slices; s++)
            _mm256_storeu_ps(part + (h0 + h) * (head_dim + 2) + 2 + 8 * (s0 + s), acc[h * slices + s]);
}

/* Every unit through weigh_shared8 where the group and the head's slices allow: returns how many 16-value units
 * of all the heads' values laid end to end that was (all, or none). A group of three (the 3B file), three heads a
 * pass, each value slice widened once for all three instead of once per head (weigh_slices8): 5.3 -> 4.8 us a work
 * item of three heads of 128 (measured as score_all8 says). */
static int64_t weigh_all_shared8(const float *scores, const uint16_t *const *value_of, int64_t count, int64_t group,
                                 int64_t head_dim, float *part) {
    const int64_t slices = head_dim / 8;
    if (head_dim % 8 != 0) return 0;
#define SHARED8(heads) for (int64_t h0 = 0; h0 < group; h0 += heads) \
                           for (int64_t s0 = 0; s0 < slices; s0 += 8 / heads) \
                               weigh_shared8(scores, value_of, count, group, head_dim, h0, s0, part, heads)
    if (group % 4 == 0 && slices % 2 == 0) {
        SHARED8(4);
    } else if (group % 2 == 0 && slices % 4 == 0) {
        SHARED8(2);
    } else if (group % 3 == 0 && slices % 2 == 0) {
        SHARED8(3);
    } else {
        return 0;
    }
#undef SHARED8
    return group * head_dim / 16;
}

/* Head h's weighted values, eight values at a time, summed over the chunk's positions in order in a
 * register: the loop below's operations (a product, then a sum), in its order, so the same bits.
 * Why: that loop ran value by value (each one converted from float16 on its own), and took 80% of
 * attention in a prompt chunk on AVX2. Measured on the avx2 variant (Xeon, two threads, alternating in
 * one process, same bits): prefill of 512 tokens, the 1.1B file 75.4 -> 101 tok/s, the default model
 * 326 -> 575; decode after it 22.0 -> 27.0 and 57.3 -> 68.8. Returns how many values it summed. */
static int64_t weigh_slices8(const float *scores, const uint16_t *const *value_of, int64_t count, int64_t group,
                             int64_t head_dim, int64_t h, float *acc) {
    int64_t d = 0;
    for (; d + 32 <= head_dim; d += 32) { /* four slices at once: four chains, one weight load */
        __m256 sum[4];
        for (int i = 0; i < 4; i++) sum[i] = _mm256_setzero_ps();
        for (int64_t p = 0; p < count; p++) {
            const __m256 weight = _mm256_set1_ps(scores[p * group + h]);
            for (int i = 0; i < 4; i++) {
                const __m256 value = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(value_of[p] + d + 8 * i)));
                sum[i] = _mm256_add_ps(sum[i], _mm256_mul_ps(weight, value));
            }
        }
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(acc + d + 8 * i, sum[i]);
    }
    for (; d + 8 <= head_dim; d += 8) {
        __m256 sum = _mm256_setzero_ps();
        for (int64_t p = 0; p < count; p++) {
            const __m256 value = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(value_of[p] + d)));
            sum = _mm256_add_ps(sum, _mm256_mul_ps(_mm256_set1_ps(scores[p * group + h]), value));
        }
        _mm256_storeu_ps(acc + d, sum);
    }
    return d;
}
#endif

/* Per head h (0 .. n - 1) of a chunk's scores, scores[p * group + h]: heads_max gives the max over the positions,
 * heads_sum the sum in position order. Several heads a vector, a head a lane: each lane makes the scalar loop's
 * comparisons (s > best ? s : best, so a NaN keeps the max before it) and additions, in its order, so the same
 * bits. Why: head by head, the two loops and the exponentials took 21 of a work item's 92 cycles a position
 * (eight heads of 64, one thread, in cache, Zen 5). Measured per work item of 128 positions (in cache, one
 * thread, the builds in turn in one process, same bits): eight heads of 64 4.94 -> 4.47 us, three of 128 3.69
 * -> 3.30, four of 256 5.34 -> 4.80 (the avx2 kernels: eight of 64 6.86 -> 6.56, three of 128 5.95 -> 5.82),
 * each with some 1.3 us of calling it from Python. Decoding the 1.1B file after a prompt of 2048 tokens (two
 * threads, windows in turn, bench/builds.py): 75.6 -> 77.3 tok/s, llama.cpp 34.8. */
static inline void heads_max(const float *scores, int64_t count, int64_t group, int64_t n, float *best) {
    int64_t h = 0;
#if defined(__AVX512F__)
    for (; h < n; h += 16) {
        const __mmask16 lanes = n - h >= 16 ? 0xffff : (__mmask16)((1u << (n - h)) - 1);
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t p = 0; p < count; p++)
            m = _mm512_max_ps(_mm512_maskz_loadu_ps(lanes, scores + p * group + h), m);
        _mm512_mask_storeu_ps(best + h, lanes, m);
    }
#elif defined(LLORCH_AVX2)
    for (; h + 8 <= n; h += 8) {
        __m256 m = _mm256_set1_ps(-INFINITY);
        for (int64_t p = 0; p < count; p++) m = _mm256_max_ps(_mm256_loadu_ps(scores + p * group + h), m);
        _mm256_storeu_ps(best + h, m);
    }
#endif
    for (; h < n; h++) {
        best[h] = -INFINITY;
        for (int64_t p = 0; p < count; p++) best[h] = scores[p * group + h] > best[h] ? scores[p * group + h] : best[h];
    }
}

static inline void heads_sum(const float *scores, int64_t count, int64_t group, int64_t n, float *total) {
    int64_t h = 0;
#if defined(__AVX512F__)
    for (; h < n; h += 16) {
        const __mmask16 lanes = n - h >= 16 ? 0xffff : (__mmask16)((1u << (n - h)) - 1);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < count; p++)
            sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(lanes, scores + p * group + h));
        _mm512_mask_storeu_ps(total + h, lanes, sum);
    }
#elif defined(LLORCH_AVX2)
    for (; h + 8 <= n; h += 8) {
        __m256 sum = _mm256_setzero_ps();
        for (int64_t p = 0; p < count; p++) sum = _mm256_add_ps(sum, _mm256_loadu_ps(scores + p * group + h));
        _mm256_storeu_ps(total + h, sum);
    }
#endif
    for (; h < n; h++) {
        total[h] = 0.0f;
        for (int64_t p = 0; p < count; p++) total[h] += scores[p * group + h];
    }
}

void llorch_to_fp16(const float *src, int64_t n, uint16_t *dst) { store_fp16(dst, src, n); }

static inline int64_t gcd16(int64_t n) {
    int64_t g = 16;
    while (n % g) g /= 2;
    return g;
}

void llorch_attend_chunk(const float *q_row, const uint16_t *keys, const uint16_t *values, int64_t g, int64_t group,
                         int64_t head_dim, int64_t kv_heads, float scale, const int64_t *slots, int64_t first,
                         int64_t last, float *scores, float *part, int from_memory) {
    llorch_attend_chunk_then(q_row, keys, values, g, group, head_dim, kv_heads * head_dim, head_dim, scale, slots, first,
                             last, scores, part, from_memory, NULL);
}

void llorch_attend_chunk_then(const float *q_row, const uint16_t *keys, const uint16_t *values, int64_t g,
                              int64_t group, int64_t head_dim, int64_t slot_stride, int64_t head_stride, float scale,
                              const int64_t *slots, int64_t first, int64_t last, float *scores, float *part,
                              int from_memory, const attend_next *then) {
    const int64_t count = last - first, units = count * group;
    ahead next = {keys, values, slots, slot_stride, 0, head_dim, 0, 0, 0};
    if (then != NULL) {
        next.slots = then->slots + then->first;
        next.offset = then->g * head_stride;
        next.count = then->last - then->first;
        if (units > 0) next.share = ((uint64_t)next.count << 32) / (uint64_t)units;
    }
    const float *q = q_row + g * group * head_dim;
    const uint16_t *key_of[ATTN_CHUNK], *value_of[ATTN_CHUNK];
    for (int64_t p = 0; p < count; p++) {
        key_of[p] = keys + slots[first + p] * slot_stride + g * head_stride;
        value_of[p] = values + slots[first + p] * slot_stride + g * head_stride;
    }
    /* The step's cache is [kv_heads, slots, head_dim]: a head's keys (and values) of a block of slots lie
     * together, one run of bytes, where with all the heads of a slot together a work item read one
     * head's short piece of every slot, a whole row of heads apart, which the prefetchers barely
     * follow. Measured decoding after a prompt of 2048 tokens (two threads, Zen 4, the two builds in
     * turn, three rounds of bench/step_profile.py): the 3B file's attention 17.8 / 18.1 / 18.0 -> 14.9 /
     * 13.2 / 13.0 ms a token (the 1.1B file's, bound by its arithmetic, 4.7-5.3 either way); bench/builds.py
     * --context 2048 beside llama.cpp, 3B 14.2 -> 15.3 tok/s (llama.cpp 11.4); prefill of 512 tokens
     * 75-79 -> 83-84 tok/s (3B), 212-225 -> 229 (1.1B).
     * Every key and value of the chunk asked for into L2 at once: in decode they come from memory (the
     * weights read since pushed them out of the cache). The loops below still ask AHEAD positions ahead
     * into L1. Measured per work item from memory (1.1B's shape, one thread, Zen 4): 15.9 -> 12.4 us;
     * the 1.1B file's attention at 512 positions 2.4 -> 2.05 ms per token. The later rows of a sequence
     * in one step read the keys its first row just read: there the requests only cost instructions (the default model's
     * prefill of 512 tokens 1717 -> 1760 tok/s without them, Xeon, two threads, alternating in one
     * process). Asked for all at once, they still came while the item waited: so the item before on
     * the same thread asks for them as it computes its scores (`then`), and only a thread's first item
     * asks here. Measured decoding after a prompt of 2048 tokens (two threads, Zen 4, bench/step_profile.py,
     * the two builds in turn, three rounds): attention 4.80-5.38 -> 4.42-5.38 ms a token on the 1.1B
     * file, 18.6-19.5 -> 14.8-17.2 on the 3B. */
    if (from_memory) {
        ahead own = {keys, values, slots + first, slot_stride, g * head_stride, head_dim, count, 0, 0};
        ahead_to(&own, count);
    }
    for (int64_t p = 0; p < count && p < AHEAD; p++) prefetch_halves(key_of[p], head_dim);
    /* scores[p * group + h] = scale * q_h . key_p */
    int64_t u = 0;
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) {
        score_all16(q, key_of, count, group, head_dim, scale, units, scores, &next);
        u = units / 16 * 16;
    }
#endif
#if defined(LLORCH_AVX2) && !defined(__AVX512F__)
    if (head_dim % 8 == 0) u = score_all8(q, key_of, count, group, head_dim, scale, scores, &next);
#endif
    for (; u < units; u++) scores[u] = dot_f32_f16(q + (u % group) * head_dim, key_of[u / group], head_dim) * scale;
    ahead_to(&next, next.count);

    /* per head: the chunk's max score, its weights e^(s - max) and their sum (heads_max, heads_sum: a head a
     * lane, each in position order) */
    float best[MAX_GROUP], total[MAX_GROUP];
    const int64_t together = group < MAX_GROUP ? group : MAX_GROUP;
    for (int64_t h0 = 0; h0 < group; h0 += together) {
        const int64_t n = group - h0 < together ? group - h0 : together;
        heads_max(scores + h0, count, group, n, best);
        if (n == group) {
            /* e^(s - max) is elementwise: sixteen units at a time (vectorized), then each head's
             * sum in position order as before, so the bits do not change. Unit i is head i % group;
             * a group that does not divide sixteen (three, say) starts each sixteen at another head.
             * Measured with score16_of3 (3B, group of three, two threads, Zen 4, same process
             * alternating): attention of 16 rows at 512 positions 91.9 -> 81.8 ms, of 32 rows at 64
             * positions 21.3 -> 19.2 ms. */
            /* Each unit's max, laid out once for as many units as it takes to repeat (a multiple of
             * sixteen). Filled anew for every sixteen units, the vector load of them waited for the
             * sixteen stores just made: the 1.1B file's prefill of 512 tokens 274.8 -> 282.2 and
             * 274.4 -> 293.4 tok/s in two runs (Xeon, two threads, alternating in one process, same
             * bits); the default model's, whose heads are four times as wide, unchanged. */
            float shifts[MAX_GROUP * 16];
            const int64_t period = 16 * group / gcd16(group);
            for (int64_t l = 0; l < period; l++) shifts[l] = best[l % group];
            int64_t i = 0;
            for (; i + 16 <= units; i += 16) {
                const float *shift = shifts + i % period;
#if defined(LLORCH_AVX2) && !defined(__AVX512F__) /* written out: the compiler left it value by value */
                for (int l = 0; l < 16; l += 8)
                    _mm256_storeu_ps(scores + i + l, v_exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i + l),
                                                                          _mm256_loadu_ps(shift + l))));
#else
                for (int l = 0; l < 16; l++) scores[i + l] = v_exp(scores[i + l] - shift[l]);
#endif
            }
            for (; i < units; i++) scores[i] = v_exp(scores[i] - best[i % group]);
            heads_sum(scores + h0, count, group, n, total);
        } else {
            for (int64_t h = 0; h < n; h++) total[h] = 0.0f;
            for (int64_t p = 0; p < count; p++) {
                float *s = scores + p * group + h0;
                for (int64_t h = 0; h < n; h++) {
                    s[h] = v_exp(s[h] - best[h]);
                    total[h] += s[h];
                }
            }
        }
        for (int64_t h = 0; h < n; h++) {
            part[(h0 + h) * (head_dim + 2)] = best[h];
            part[(h0 + h) * (head_dim + 2) + 1] = total[h];
        }
    }

    /* per head: the weighted sum of the values, not yet normalized */
    int64_t v = 0;
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) v = weigh_all8(scores, value_of, count, group, head_dim, part);
#endif
#if defined(LLORCH_AVX2) && !defined(__AVX512F__)
    v = weigh_all_shared8(scores, value_of, count, group, head_dim, part);
#endif
    /* what is left, value by value: from value v * 16 of all the heads' values laid end to end */
    for (int64_t h = v * 16 / head_dim; h < group; h++) {
        int64_t from = h == v * 16 / head_dim ? v * 16 % head_dim : 0;
        float *restrict acc = part + h * (head_dim + 2) + 2;
#if defined(LLORCH_AVX2) && !defined(__AVX512F__)
        if (from == 0) from = weigh_slices8(scores, value_of, count, group, head_dim, h, acc);
#endif
        for (int64_t d = from; d < head_dim; d++) acc[d] = 0.0f;
        for (int64_t p = 0; p < count; p++) {
            const float weight = scores[p * group + h];
            for (int64_t d = from; d < head_dim; d++) acc[d] += weight * fp16_to_fp32(value_of[p][d]);
        }
    }
}
