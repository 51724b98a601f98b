/* Matrix products against GGUF-typed weight rows, read at the file's own width.
 *
 * Block types: the activation rows are quantized once (act_block: int8 per 32 values,
 * one float scale), each weight row is unpacked into the uniform form of blocks.c,
 * and the dot is integer within each half-block (exact), then scaled in float:
 *     x . w = sum_b  dx_b * (s_b0 * idot_b0 + s_b1 * idot_b1 - m_b0 * xsum_b0 - m_b1 * xsum_b1)
 * Float types (F32, F16, BF16) take the float activations directly.
 *
 * Every output is summed in one fixed order whatever the number of rows in the call or
 * the thread that computes it, so a row's result does not depend on its batch.
 */
#include <sched.h>
#include <stdlib.h>

#include "simd.h"

#define ROW_CHUNK 16  /* weight rows per scheduling unit */
_Static_assert(ROW_CHUNK == 2 * 8, "an interleaved matrix's chunk is two groups of eight rows (units below)");
#define ACT_TILE 64   /* activation rows read against one unpacked weight row before moving on */
#define DIRECT_TILE 4 /* activation rows the direct kernels take at once (direct.c) */
#define SEGMENT_PASS_ROWS 16 /* fewer activation rows go through an interleaved matrix a segment at a time */

/* Per-thread scratch for one unpacked weight row, grown as needed. */
static __thread uint8_t *scratch_v;
static __thread float *scratch_sm;
static __thread int64_t scratch_k;

/* Its `v` is NULL when it could not grow: the caller skips the work and the step fails (alloc.c). */
static unpacked_row scratch_row(int64_t k) {
    if (k > scratch_k) {
        free(scratch_v);
        free(scratch_sm);
        scratch_v = llorch_alloc((size_t)k);
        scratch_sm = llorch_alloc(sizeof(float) * (size_t)(k / QK * 4));
        scratch_k = scratch_v && scratch_sm ? k : 0;
        if (!scratch_k) {
            free(scratch_v);
            free(scratch_sm);
            scratch_v = NULL;
            scratch_sm = NULL;
            const unpacked_row none = {NULL, NULL, NULL};
            return none;
        }
    }
    const unpacked_row u = {scratch_v, scratch_sm, scratch_sm + k / QK * 2};
    return u;
}

/* x . w for one quantized activation row and one unpacked weight row of `blocks` blocks. */
static inline float dot_unpacked(const unpacked_row *u, const act_block *x, int64_t blocks, int is_signed) {
    float offsets = 0.0f;
#ifdef LLORCH_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(u->v + b * QK));
        const __m256i q = _mm256_loadu_si256((const __m256i *)x[b].q);
        const __m256i lanes = is_signed ? idot_signed(w, q) : idot_unsigned(w, q);
        const float dx = x[b].d;
        const __m256 scale = _mm256_set_m128(_mm_set1_ps(u->s[2 * b + 1] * dx), _mm_set1_ps(u->s[2 * b] * dx));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), scale, acc);
        offsets += dx * (u->m[2 * b] * x[b].sum[0] + u->m[2 * b + 1] * x[b].sum[1]);
    }
    return hsum8(acc) - offsets;
#else
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        int32_t half[2] = {0, 0};
        for (int j = 0; j < QK; j++) {
            const int32_t w = is_signed ? (int32_t)(int8_t)u->v[b * QK + j] : (int32_t)u->v[b * QK + j];
            half[j / 16] += w * x[b].q[j];
        }
        const float dx = x[b].d;
        total += dx * (u->s[2 * b] * (float)half[0] + u->s[2 * b + 1] * (float)half[1]);
        offsets += dx * (u->m[2 * b] * x[b].sum[0] + u->m[2 * b + 1] * x[b].sum[1]);
    }
    return total - offsets;
#endif
}

/* x . w for float activations and a float-typed weight row. */
static float dot_float(int type, const uint8_t *row, const float *x, int64_t k) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef LLORCH_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) {
        __m256 w;
        if (type == T_F32) {
            w = _mm256_loadu_ps((const float *)row + i);
        } else if (type == T_F16) {
            w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
        } else {
            const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
            w = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
        }
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), w, acc);
    }
    total = hsum8(acc);
#endif
    for (; i < k; i++) {
        uint16_t h;
        memcpy(&h, row + 2 * i, 2);
        const float w = type == T_F32 ? ((const float *)row)[i] : type == T_F16 ? fp16_to_fp32(h) : bf16_to_fp32(h);
        total += x[i] * w;
    }
    return total;
}

static inline int is_float_type(int type) { return type == T_F32 || type == T_F16 || type == T_BF16; }

/* What the chunk loop needs of one matrix, found once per product. Asked again for every chunk of
 * sixteen rows, whose kernel call takes a few hundred nanoseconds, the calls (and the unpacking scratch
 * the interleaved kernels never read) were 4.3% of the CPU time of decoding the default model, now 2.0%
 * (two threads, Zen 5, sampled); decode's speed was level, bound by memory. */
typedef struct {
    int64_t row_bytes, block_values, group_bytes, amx_rows;
    int is_float, is_signed, interleaved, direct;
} matrix_facts;

/* Row values v[0..n) at columns j.. into a thread's row_best slot: the first index of the largest, unless a NaN
 * was seen. Eight values at a time are first asked, in one comparison, whether any of them could change it (not
 * less than the largest so far, or a NaN): the common case is no. */
static inline void note_best(float *max, int64_t *at, const float *v, int64_t j, int64_t n) {
    int64_t i = 0;
#ifdef LLORCH_AVX2
    if (*at != -2) {
        const __m256 largest = _mm256_set1_ps(*max);
        while (i + 8 <= n && _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), largest, _CMP_NLT_UQ)) == 0)
            i += 8;
    }
#endif
    for (; i < n; i++) {
        if (*at == -1) return;
        const float value = v[i];
        if (value != value) {
            *at = -1;
            return;
        }
        if (*at == -2 || value > *max || (value == *max && j + i < *at)) {
            *max = value;
            *at = j + i;
        }
    }
}

void llorch_best_join_ws(const row_best *best, int teams, int64_t m, int64_t *out) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t i = 0; i < m; i++) {
        int64_t at = -2;
        float max = 0.0f;
        for (int t = 0; t < teams && at != -1; t++) {
            const int64_t there = best->at[t * best->stride + i];
            const float value = best->max[t * best->stride + i];
            if (there == -2) continue;
            if (there == -1 || at == -2 || value > max || (value == max && there < at)) {
                at = there;
                max = value;
            }
        }
        out[i] = at;
    }
}

/* One product's facts for its chunks, the same for every chunk and pass. */
typedef struct {
    const matrix *mats;
    const matrix_facts *facts;
    const int64_t *first_chunk;
    const float *x;
    const act_block *xq;
    float *const *outs;
    const amx_acts *acts;
    const row_best *best;
    int64_t m, k, blocks, segments, passes, amx_rows, slot;
    int ahead;
} product;

/* Chunk c of a product (sixteen rows of one of its matrices) in pass `pass`; amx_k: the thread's tile configuration. */
static inline void product_chunk(const product *P, int64_t c, int64_t pass, int *amx_k) {
    const matrix *mats = P->mats;
    const matrix_facts *facts = P->facts;
    const int64_t *first_chunk = P->first_chunk;
    const float *x = P->x;
    const act_block *xq = P->xq;
    float *const *outs = P->outs;
    const amx_acts *acts = P->acts;
    const row_best *best = P->best;
    const int64_t m = P->m, k = P->k, blocks = P->blocks, segments = P->segments, passes = P->passes;
    const int64_t amx_rows = P->amx_rows, slot = P->slot;
    const int ahead = P->ahead;
    const int which = matrix_of(first_chunk, c);
    const matrix *W = mats + which;
    const matrix_facts *f = facts + which;
    const int64_t row_bytes = f->row_bytes, n = W->rows;
    const int64_t j0 = (c - first_chunk[which]) * ROW_CHUNK, j1 = j0 + ROW_CHUNK < n ? j0 + ROW_CHUNK : n;
    const int is_float = f->is_float, is_signed = f->is_signed, interleaved = f->interleaved, direct = f->direct;
    if (pass > 0 && !interleaved) return;  /* done in the first */
    /* Interleaved: chunk `unit` is groups unit and unit + half (eight rows each; a last odd group
     * alone), so that a thread's consecutive chunks read two long runs of bytes, which the hardware
     * prefetchers follow, instead of two short runs per chunk (groups 2u and 2u + 1, restarting
     * every 18 KiB on a 2048-wide matrix). Measured decoding (one stream, two threads, Zen 4, same
     * process alternating): the 1.1B file 35.8 -> 45.8 tok/s (gate and up 22 -> 31 GB/s), the 3B
     * file 13.1 -> 15.7. Asking for the bytes ahead in software, every line or only each run's
     * first ones, was slower than leaving it to the prefetchers here. */
    const int64_t half = n / 8 / 2, unit = c - first_chunk[which];
    const int64_t ga = unit < half ? unit : 2 * half, gb = unit < half ? unit + half : ga;
    float *out = outs[which];
    /* the unpacked row's scratch, which only the row-at-a-time path below reads */
    unpacked_row u = {NULL, NULL, NULL};
    if (!interleaved) {
        u = scratch_row(is_float || direct ? QK : k);
        if (u.v == NULL) return;
    }
    /* Sixteen activation rows at a time on AMX where the CPU has it; the rest below, same bits. */
    const int64_t first_row = amx_rows > 0 ? f->amx_rows : 0;
    if (first_row > 0 && pass == 0)
        llorch_amx_groups(W->type, W->data, n, k, ga, gb, acts, first_row / 16, out, n, amx_k);
    const int64_t block_values = f->block_values, group_bytes = f->group_bytes;
    for (int64_t i0 = first_row; i0 < m; i0 += ACT_TILE) {
        const int64_t i1 = i0 + ACT_TILE < m ? i0 + ACT_TILE : m;
        if (interleaved) {  /* eight weight rows per instruction, up to eight activation rows at a time */
            /* this pass's segment, or every segment in turn */
            const int64_t first_segment = passes > 1 ? pass : 0, end = passes > 1 ? pass + 1 : segments;
            for (int64_t segment = first_segment; segment < end; segment++) {
                /* the segment's bytes, values and first activation block */
                const uint8_t *w = W->data + llorch_block_at(group_bytes, block_values, n / 8, k, 0,
                                                             segment * (SEGMENT / block_values));
                const int64_t width = k - segment * SEGMENT < SEGMENT ? k - segment * SEGMENT : SEGMENT;
#ifdef INTERLEAVED_WIDE_ROWS
                if (i1 - i0 >= INTERLEAVED_WIDE_ROWS) {
                    llorch_interleaved_wide(W->type, w, width, ga, gb, xq + i0 * blocks + segment * (SEGMENT / QK),
                                            blocks, i1 - i0, out + i0 * n, n, segment > 0, ahead);
                    continue;
                }
#endif
                /* INTERLEAVED_TILE rows at a time while as many are left, then four at most */
                for (int64_t i = i0, tile; i < i1; i += tile) {
                    tile = i1 - i >= INTERLEAVED_TILE ? INTERLEAVED_TILE : i1 - i < 4 ? i1 - i : 4;
                    const act_block *rows[INTERLEAVED_TILE];
                    for (int t = 0; t < tile; t++) rows[t] = xq + (i + t) * blocks + segment * (SEGMENT / QK);
                    llorch_interleaved_groups(W->type, w, width, ga, gb, rows, tile, out + i * n, n,
                                              segment > 0, ahead);
                }
            }
            continue;
        }
        if (direct) {  /* decoded in registers, four activation rows at a time */
            for (int64_t i = i0; i < i1; i += DIRECT_TILE) {
                const int tile = i1 - i < DIRECT_TILE ? (int)(i1 - i) : DIRECT_TILE;
                const act_block *rows[DIRECT_TILE];
                for (int t = 0; t < tile; t++) rows[t] = xq + (i + t) * blocks;
                llorch_direct_rows(W->type, W->data, row_bytes, j0, j1, k, rows, tile, out + i * n, n, i == 0);
            }
            continue;
        }
        for (int64_t j = j0; j < j1; j++) {
            const uint8_t *row = W->data + j * row_bytes;
            if (is_float) {
                for (int64_t i = i0; i < i1; i++) out[i * n + j] = dot_float(W->type, row, x + i * k, k);
            } else {
                llorch_unpack_row(W->type, row, k, &u);
                for (int64_t i = i0; i < i1; i++)
                    out[i * n + j] = dot_unpacked(&u, xq + i * blocks, blocks, is_signed);
            }
        }
    }
    /* The chunk's outputs are final once its last pass is done: noted while they are in cache. Why:
     * found after the step, the argmax read the logits once more, 40 us a token on the default
     * model's 262k vocabulary (two threads, Zen 5), which is 1% of its step. */
    if (best != NULL && pass == passes - 1) {
        for (int64_t i = 0; i < m; i++) {
            const float *row = out + i * n;
            float *max = best->max + slot + i;
            int64_t *at = best->at + slot + i;
            if (interleaved) {
                note_best(max, at, row + 8 * ga, 8 * ga, 8);
                if (gb != ga) note_best(max, at, row + 8 * gb, 8 * gb, 8);
            } else {
                note_best(max, at, row + j0, j0, j1 - j0);
            }
        }
    }
}

/* One turn of a thread waiting for another's range: a pause, which leaves the core's shared resources to its
 * other thread, and after some 4096 turns (0.1-0.3 ms) a yield as well. Why: with more threads than cores (or a
 * server's threads beside the step's) the thread waited for may be the one the spinning one keeps off its core. */
static inline void wait_turn(int *turns) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
    if (++*turns > 4096) sched_yield();
}

/* A chunk_share's range word: the product's number (12 bits), the pass its owner is in (8), then the first and the
 * end of the chunks left in that pass (22 each). */
#define SHARE_BITS 22
#define SHARE_MASK ((UINT64_C(1) << SHARE_BITS) - 1)
#define PASS_SHIFT (2 * SHARE_BITS)
#define PASS_MASK 0xff /* also the most passes a product may have and take chunks */
#define NUMBER_SHIFT (PASS_SHIFT + 8)
#define NUMBER_MASK 0xfff
typedef struct {
    uint64_t number;
    int64_t pass, from, to;
} share_range;

static inline uint64_t range_word(share_range r) {
    return r.number << NUMBER_SHIFT | (uint64_t)r.pass << PASS_SHIFT | (uint64_t)r.from << SHARE_BITS |
           (uint64_t)r.to;
}

static inline share_range range_of(uint64_t word) {
    const share_range r = {word >> NUMBER_SHIFT, (int64_t)(word >> PASS_SHIFT & PASS_MASK),
                           (int64_t)(word >> SHARE_BITS & SHARE_MASK), (int64_t)(word & SHARE_MASK)};
    return r;
}

static int64_t chunks_taken; /* llorch_take_chunks_taken's count */

int64_t llorch_take_chunks_taken(void) { return __atomic_exchange_n(&chunks_taken, 0, __ATOMIC_RELAXED); }

/* The first of thread t's chunks in its fixed share of `chunks` among `crew` threads (as a static schedule). */
static inline int64_t share_first(int64_t chunks, int crew, int t) {
    const int64_t base = chunks / crew, extra = chunks % crew;
    return t * base + (t < extra ? t : extra);
}

/* A decode step's chunks: each thread its fixed share (llorch_matmul_group_ws says why), pass by pass, from the
 * front; then, its own done, it takes chunks off the end of another thread's share, about half of the work that
 * share has left, and does each taken chunk's passes from the one its owner is in.
 * Why: the shares are equal in bytes, but the host runs the two threads at unequal speeds, so at each product's
 * barrier one of them waited, and one thread alone reads memory at some 12 GB/s where two read 16-21. Measured
 * decoding one stream (two threads, Zen 3, the step's product barriers timed): a thread waited 2-4.6 ms of the
 * 1.1B file's 33-39 ms a token, 3-21 ms of the 3B's 108-126; now 0.3-0.9 ms, the barriers' own cost. The builds
 * in turn beside a read probe (48 windows): the 1.1B file 0.79 -> 0.88 of the probe (1.12x tok/s), the 3B 0.87
 * -> 0.88, the default model 0.99 -> 1.00 (1.06x tok/s); 8 to 32 streams level (0.98-1.13x, within the noise).
 * Taking chunks only off the last pass (each owner's earlier passes its own) left the 3B at 0.87 -> 0.83: its
 * down projection is eight passes, and the thread ahead spun until the other began its last.
 * Every claim goes through the share's range word: its owner takes a few chunks at a time from the front (a
 * compare-exchange on a line the others read only once they are done), another thread lowers its end. A chunk's
 * passes so run in order, its earlier ones by the owner, which moves to a pass only through the word (release)
 * once it is done with the one before: a thread that takes the chunk through the word (acquire) reads its
 * outputs so far as written. Each chunk's own arithmetic is unchanged: the same bits on whichever thread. */
static void decode_chunks(const product *P, int64_t chunks, int64_t passes, chunk_share *shares, int *amx_k) {
#ifdef _OPENMP
    const int tid = omp_get_thread_num(), crew = omp_get_num_threads();
#else
    const int tid = 0, crew = 1;
#endif
    const int64_t first = share_first(chunks, crew, tid), end = share_first(chunks, crew, tid + 1), last = passes - 1;
    if (shares == NULL || crew == 1 || chunks > (int64_t)SHARE_MASK || passes > PASS_MASK) {
        for (int64_t pass = 0; pass < passes; pass++)
            for (int64_t c = first; c < end; c++) product_chunk(P, c, pass, amx_k);
        return;
    }
    chunk_share *own = shares + tid;
    const uint64_t number = ++own->products & NUMBER_MASK;
    const share_range start = {number, 0, first, end};
    __atomic_store_n(&own->range, range_word(start), __ATOMIC_RELEASE);
    for (;;) {
        uint64_t word = __atomic_load_n(&own->range, __ATOMIC_RELAXED);
        share_range r = range_of(word);
        if (r.from >= r.to) {  /* this pass done: the next one over what is left of the share, or the end */
            if (r.pass == last || r.to == first) break;
            const share_range next = {number, r.pass + 1, first, r.to};
            __atomic_compare_exchange_n(&own->range, &word, range_word(next), 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
            continue;
        }
        const int64_t from = r.from, take = 1 + (r.to - r.from) / 32 < 4 ? 1 + (r.to - r.from) / 32 : 4;
        r.from += take;
        if (!__atomic_compare_exchange_n(&own->range, &word, range_word(r), 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            continue;
        for (int64_t c = from; c < from + take; c++) product_chunk(P, c, r.pass, amx_k);
    }
    for (int other = 1; other < crew; other++) {
        const int t = (tid + other) % crew;
        const int64_t their_first = share_first(chunks, crew, t);
        chunk_share *theirs = shares + t;
        int turns = 0;
        for (;;) {
            uint64_t word = __atomic_load_n(&theirs->range, __ATOMIC_ACQUIRE);
            share_range r = range_of(word);
            if (r.number != number) {
                if (((r.number + 1) & NUMBER_MASK) != number) break; /* not a product behind: nothing to take */
                wait_turn(&turns); /* not yet begun this product: its range comes */
                continue;
            }
            /* the chunk passes it has left: the rest of this pass, and every later pass over its share */
            const int64_t left = r.to - r.from + (last - r.pass) * (r.to - their_first);
            if (left == 0) break;
            if (r.from >= r.to) {  /* between two passes */
                wait_turn(&turns);
                continue;
            }
            const int64_t passes_left = last - r.pass + 1, half = (left + 2 * passes_left - 1) / (2 * passes_left);
            const int64_t take = half < r.to - r.from ? half : r.to - r.from, to = r.to;
            r.to -= take;
            if (!__atomic_compare_exchange_n(&theirs->range, &word, range_word(r), 0, __ATOMIC_ACQ_REL,
                                             __ATOMIC_ACQUIRE))
                continue;
            __atomic_add_fetch(&chunks_taken, take, __ATOMIC_RELAXED);
            for (int64_t pass = r.pass; pass < passes; pass++)
                for (int64_t c = to - take; c < to; c++) product_chunk(P, c, pass, amx_k);
        }
    }
}

void llorch_matmul_group_ws(const matrix *mats, int count, const float *x, const act_block *xq, int64_t m,
                            float *const *outs, const row_best *best, chunk_share *shares) {
    int64_t first_chunk[4] = {0, 0, 0, 0};
    for (int i = 0; i < count; i++) first_chunk[i + 1] = first_chunk[i] + (mats[i].rows + ROW_CHUNK - 1) / ROW_CHUNK;
    const int64_t k = mats[0].cols, blocks = k / QK;
#ifdef _OPENMP
    const int64_t slot = best != NULL ? omp_get_thread_num() * best->stride : 0;
#else
    const int64_t slot = 0;
#endif
    if (best != NULL)
        for (int64_t i = 0; i < m; i++) best->at[slot + i] = -2;
    int amx_k = 0; /* this thread's tile configuration in this product (amx.c) */
    /* The rows AMX takes of any of the matrices, regrouped by tile once for every chunk (each matrix
     * takes llorch_amx_rows of its own type: all of these, or none). */
    int64_t amx_rows = 0;
    matrix_facts facts[3];
    for (int i = 0; i < count; i++) {
        const int type = mats[i].type;
        const matrix_facts f = {llorch_row_bytes(type, k), llorch_block_values(type), llorch_group_bytes(type),
                                llorch_amx_rows(type, m), is_float_type(type), type == T_Q8_0, type > REPACKED,
                                llorch_has_direct(type)};
        facts[i] = f;
        amx_rows = f.amx_rows > amx_rows ? f.amx_rows : amx_rows;
    }
    amx_acts acts = {NULL, NULL, NULL};
    if (amx_rows > 0) {
#ifdef _OPENMP
#pragma omp single copyprivate(acts)
#endif
        {
            acts.q = llorch_alloc((size_t)(amx_rows * k));
            acts.d = llorch_alloc(sizeof(float) * (size_t)(amx_rows * blocks));
            acts.dsum = llorch_alloc(sizeof(float) * (size_t)(amx_rows * blocks));
        }
        if (acts.q && acts.d && acts.dsum) llorch_amx_pack_ws(xq, amx_rows / 16, blocks, &acts);
        else amx_rows = 0; /* the step fails (alloc.c); the other kernels still leave nothing unwritten */
    }
    /* An interleaved matrix wider than a segment: each output goes on from segment to segment. Decoding's
     * few rows go through the matrix a segment at a time, every chunk of rows in each (llorch.h says why);
     * more rows take each chunk's segments in turn, each tile of rows's outputs carried in cache (carried
     * through memory, the outputs of a prompt's 512 rows came and went once a segment: prefill lost 7%).
     * The other types, and the rows AMX takes, take all of k in the first pass. */
    int64_t segments = 1;
    for (int i = 0; i < count; i++)
        if (mats[i].type > REPACKED) segments = (k + SEGMENT - 1) / SEGMENT;
    const int64_t passes = m < SEGMENT_PASS_ROWS ? segments : 1;
    /* A decode step's rows, one stream's or a batch's: the kernels ask for the weights ahead of what
     * they read. Why, for a batch: each tile after the first reads the weights from the cache, and
     * while it computes nothing asks memory for more (the prefetchers follow the reads that miss), so
     * a step's time was its time computing plus its time reading. Measured (two threads, Zen 5, same
     * model, alternating windows): 4 / 8 / 16 / 32 streams 1.09-1.15x / 1.50x / 1.26x / 1.09x on the
     * 1.1B file; the default model 1.07x / 1.49x / 1.26x / 1.10x; the 3B 1.09x / 1.53x / 1.23x (4 / 8
     * / 16); the AVX2 kernels on the 1.1B file 1.16x / 1.40x / 1.23x / 1.07x. At 8 streams,
     * PREFETCH_AHEAD (simd.h) 2048 and 8192 were slower than its 4096: 0.92x and 0.96x.
     * Why, for one stream: the prefetchers alone keep up while memory is slow, and fall behind while
     * it is fast. Measured on Zen 5 (two threads, windows in turn, each held to a read probe beside
     * it): with the probe at 70-80 GB/s, the 3B file 1.05-1.06x, the 1.1B file 1.06-1.09x; at 40-50 GB/s
     * 1.00-1.03x (the 1.1B file two / three streams 1.04x / 1.05x); the default model level; the
     * AVX2 kernels 1.01x (measured once they asked at all: simd.h's prefetch_ahead). Nearer is worse
     * for one stream: 2 KiB ahead 0.96x at 70-80 GB/s (an earlier measurement, 1 KiB: 0.90x); farther
     * too: 6 / 8 / 16 KiB 0.97x / 0.95x / 0.93x at 65-75 GB/s, 0.97-0.98x at 40-45. On Zen 4, one
     * stream asking 2 and 4 KiB ahead was measured slower than the prefetchers alone: to be measured
     * there again. A prompt's many rows are bound by computing: they do not ask. */
    const int ahead = m <= ACT_TILE;
    /* A decode step's rows, few: each thread takes a fixed share of the chunks, the same share in every pass,
     * so that no pass waits for the one before (each output goes on in the thread that began it) and no chunk
     * is claimed through a count both threads write while both have work (decode_chunks: only a thread done
     * with its own share takes the end of another's). Why: where the host puts the two threads on cores
     * that share no cache, a line passing between them takes 400-700 ns instead of 100 (and the read probe
     * finds 60-75 GB/s instead of 30-50); guided's claims and the barriers between passes then cost every
     * product a few microseconds. Measured decoding one stream (two threads, Zen 5, windows in turn, each held
     * to a read probe): at 65-75 GB/s the default model 0.87-0.88 -> 0.94-0.95 of the probe, the 1.1B file
     * 0.89-0.91 -> 0.93-0.94; at 40-45 GB/s level; 8 and 32 streams level. More rows (a prompt's, bound by
     * computing) keep guided: each thread first takes a long run of chunks, then ever shorter ones, so the
     * faster thread takes more instead of waiting at the barrier (measured decoding the 1.1B file when it
     * was guided for every product, two threads, Zen 4: 38.5 -> 42.9 tok/s; to be measured there again). */
    const int fixed = ahead;
    const product P = {mats, facts, first_chunk, x, xq, outs, &acts, best, m, k, blocks, segments, passes, amx_rows,
                       slot, ahead};
    const int64_t chunks = first_chunk[count];
    if (fixed) {
        decode_chunks(&P, chunks, passes, shares, &amx_k);
#ifdef _OPENMP
#pragma omp barrier
#endif
    } else {
        for (int64_t pass = 0; pass < passes; pass++) {
#ifdef _OPENMP
#pragma omp for schedule(guided, 8)
#endif
            for (int64_t c = 0; c < chunks; c++) product_chunk(&P, c, pass, &amx_k);
        }
    }
    if (amx_rows > 0 || acts.q || acts.d || acts.dsum) {  /* after the loop's barrier: every chunk is done */
#ifdef _OPENMP
#pragma omp single nowait
#endif
        {
            free(acts.q);
            free(acts.d);
            free(acts.dsum);
        }
    }
}

void llorch_quantize_rows_ws(const float *x, int64_t m, int64_t k, act_block *out) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t i = 0; i < m; i++) llorch_quantize_rows(x + i * k, 1, k, out + i * (k / QK));
}

/* A whole product on its own: quantizes x when the weights are a block type (into `xq`,
 * m * k / 32 blocks, provided by the caller), with `threads` threads. */
int llorch_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, act_block *xq,
                  int64_t m, float *out, int threads) {
    const matrix W = {type, 0, w, n, k};
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
        if (!is_float_type(type)) llorch_quantize_rows_ws(x, m, k, xq);
        llorch_matmul_group_ws(&W, 1, x, xq, m, &out, NULL, NULL);
    }
    return llorch_take_allocation_failure() ? -1 : 0;
}

int llorch_matmul_prompt(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *out,
                         int threads) {
    const matrix W = {type, 0, w, n, k};
    if (!llorch_bf16_takes(&W, 1)) return -2;
    uint16_t *acts = llorch_alloc(sizeof(uint16_t) * (size_t)llorch_bf16_acts_values(m, k));
    if (acts == NULL) return llorch_take_allocation_failure(), -1;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
        llorch_bf16_pack_ws(x, m, k, acts);
        llorch_bf16_matmul_ws(&W, 1, acts, m, &out);
    }
    free(acts);
    return llorch_take_allocation_failure() ? -1 : 0;
}
