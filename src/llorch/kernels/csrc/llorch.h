/* Shared declarations of llorch's CPU kernels.
 *
 * The same sources are compiled once per instruction set (portable C, AVX2, AVX-512,
 * AVX-512-VNNI); build.py picks the best variant the CPU runs. Which SIMD code is
 * used inside follows from the compiler's own macros (__AVX2__, __AVX512VNNI__, ...).
 */
#ifndef LLORCH_H
#define LLORCH_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#define LLORCH_AVX2 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define LLORCH_VNNI 1
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32       /* values per activation block and per weight (sub-)block pair of halves */
#define QK_K 256    /* values per K-quant super-block */
#define ATTN_CHUNK 128 /* keys per attention work item: fixed, so results never depend on the batch */

/* GGUF tensor types, numbered as in the file format. */
enum gguf_type {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
    /* Ours, not the file's: a file type + REPACKED is that type with every 8 rows
     * interleaved (repack.c), the same bytes in another order. */
    T_Q5_0_R8 = 1006, T_Q8_0_R8 = 1008, T_Q4_K_R8 = 1012, T_Q6_K_R8 = 1014,
};
#define REPACKED 1000

/* An activation row quantized for the integer dot: per 32 values, a float scale, the sums
 * of each half's values (for the weights' offsets) and the int8 values. `dsum` is
 * d * (sum[0] + sum[1]), the product the interleaved Q4_K kernel scales a sub-block's minimum
 * by: made once here rather than once per group of weight rows. Measured on the Q4_K kernel (5632 x 2048
 * in cache, two threads, Zen 4, 16 / 32 activation rows): 246 -> 255 / 254 -> 271 GMAC/s. */
typedef struct {
    float d;
    float dsum;
    int16_t sum[2];
    int8_t q[QK];
} act_block;

/* One weight row unpacked for the dot: per 32 values, unsigned bytes v and, per half of
 * 16 values, a scale s and an offset m, so that the weight is s * v - m. Every block type
 * (and a float row, with no offsets) comes down to this one form. */
typedef struct {
    uint8_t *v;      /* [k] */
    float *s;        /* [k / 32 * 2]: half 0, half 1 of each block */
    float *m;        /* [k / 32 * 2] */
} unpacked_row;

static inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400)) { mantissa <<= 1; exponent--; }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* float -> float16, rounded to nearest even (as F16C's conversion rounds), overflow to infinity. */
static inline uint16_t fp32_to_fp16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    const uint32_t magnitude = bits & 0x7fffffff;
    if (magnitude >= 0x7f800000) /* infinity, or NaN kept quiet */
        return (uint16_t)(sign | 0x7c00 | (magnitude > 0x7f800000 ? 0x200 | ((magnitude >> 13) & 0x3ff) : 0));
    if (magnitude >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds past 65504 */
    if (magnitude < 0x38800000) { /* a float16 subnormal (or zero): units of 2^-24, rounded half to even */
        if (magnitude < 0x33000000) return sign; /* at most half of the smallest subnormal */
        const uint32_t mantissa = (magnitude & 0x7fffff) | 0x800000, shift = 126 - (magnitude >> 23);
        const uint32_t kept = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
        return (uint16_t)(sign | (kept + (rest > half || (rest == half && (kept & 1)))));
    }
    const uint32_t rebased = magnitude - ((127 - 15) << 23), rest = rebased & 0x1fff;
    uint32_t out = rebased >> 13;
    out += rest > 0x1000 || (rest == 0x1000 && (out & 1)); /* a carry into the exponent is right too */
    return (uint16_t)(sign | out);
#endif
}

/* A little-endian 16-bit field of a block (its float16 scale, say), from any address. */
static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float bf16_to_fp32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* A weight matrix in its GGUF type: `rows` rows of `cols` values, laid out as in the file. */
typedef struct {
    int32_t type;
    int32_t unused;
    const uint8_t *data;
    int64_t rows, cols;
} matrix;

/* Which of a product's matrices work item u belongs to, where first[i] is matrix i's first item. */
static inline int matrix_of(const int64_t *first, int64_t u) {
    int which = 0;
    while (u >= first[which + 1]) which++;
    return which;
}

/* One decoder layer's weights and KV cache (see decoder.c). Absent parts are NULL. */
typedef struct {
    matrix q, k, v, o, gate, up, down;
    const float *q_bias, *k_bias, *v_bias, *o_bias;
    const float *input_norm;      /* before attention */
    const float *post_attn_norm;  /* sandwich: on the attention output; otherwise before the MLP */
    const float *pre_ffn_norm;    /* sandwich only: before the MLP */
    const float *post_ffn_norm;   /* sandwich only: on the MLP output */
    const float *q_norm, *k_norm; /* per-head norms, or NULL */
    uint16_t *keys, *values;      /* float16 [kv_heads, kv_slots, head_dim] (attention.c says why) */
    int32_t window;               /* attend to the last `window` positions only; 0: all */
    int32_t rope;                 /* which of the step's RoPE tables: 0 or 1 */
    int64_t kv_slots;             /* the cache's token slots */
} layer_desc;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, vocab, layers;
    float eps, attn_scale, embed_scale, logit_softcap; /* embed_scale, logit_softcap: 0 for none */
    int32_t sandwich, activation;                     /* activation: 0 SiLU, 1 GELU (tanh) */
    const matrix *embed;
    const float *final_norm;
    const matrix *head;
    const layer_desc *layer;
    const float *inv_freq[2]; /* per RoPE variant: head_dim / 2 inverse frequencies */
    float rope_scaling[2];    /* per RoPE variant: positions are divided by it (linear scaling) */
} model_desc;

/* A step's rows: one new token each, of one sequence each (a sequence may have several rows). */
typedef struct {
    int64_t rows;
    const int64_t *tokens, *positions, *write_slots;
    const int64_t *slot_start; /* where each row's sequence's slot list starts in `slots` (position 0) */
    const int64_t *slots;
    int64_t logit_rows_count;
    const int64_t *logit_rows;
    float *logits; /* [logit_rows_count, vocab] */
    int64_t *best; /* NULL, or [logit_rows_count]: each logits row's argmax as llorch_argmax_rows gives it */
    int64_t prompt_from; /* rows from here on are tokens of their jobs' prompts (rows: none); see project() */
} step_desc;

/* Returns 0, or -1 when a buffer could not be allocated (the logits are then void). */
int llorch_decoder_forward(const model_desc *M, const step_desc *S, int threads);

/* Checked allocation (alloc.c): 64-byte aligned, NULL on failure, which is remembered until taken. */
void *llorch_alloc(size_t bytes);
/* *buffer (a thread's scratch, kept from call to call) grown to `bytes` or more; NULL when it could not grow. */
void *llorch_grow(void **buffer, size_t *capacity, size_t bytes);
int llorch_take_allocation_failure(void);
/* Tests: the next `count` allocations fail. */
void llorch_fail_allocations(int count);
/* sizeof and every field's offsetof of struct `which` (0 matrix, 1 layer_desc, 2 model_desc, 3 step_desc). */
int64_t llorch_struct_layout(int which, int64_t *out);

/* The index of each row's largest value (the first one, as torch.argmax); -1 for a row with a NaN. */
void llorch_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out);
/* The first index of the largest of x[0..n) (its value in *max), or -1 when x holds a NaN. */
int64_t llorch_argmax_span(const float *x, int64_t n, float *max);

/* One token drawn from softmax(x / temperature) after top_k, top_p and min_p (0, 1 and 0 when
 * off), as the first in vocabulary order whose cumulative probability passes `uniform` in
 * [0, 1); -1 for a row holding a NaN or an infinity, or when scratch cannot be allocated. */
int64_t llorch_sample_row(const float *x, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                          double uniform);

/* llorch_sample_row for rows rows[0..count) of the [*, n] logits at x, row i with the i-th of each
 * parameter, into out[i], the rows shared by `threads` threads. */
void llorch_sample_rows(const float *x, int64_t n, const int64_t *rows, int64_t count, const float *temperature,
                        const int64_t *top_k, const float *top_p, const float *min_p, const double *uniform,
                        int64_t *out, int threads);

/* Constrained decoding: x[j] = -inf wherever bit j of `allowed` (bit j % 32 of word j / 32) is clear. */
void llorch_mask_row(float *x, int64_t cols, const uint32_t *allowed, int64_t words);

/* Bytes one row of `k` values takes in a type (0: not a type these kernels read). */
int64_t llorch_row_bytes(int type, int64_t k);

/* One row of a block type unpacked into `u` (returns 0 for a type that is not a block type). */
int llorch_unpack_row(int type, const uint8_t *row, int64_t k, const unpacked_row *u);

/* One row of any type these kernels read, as floats. */
void llorch_dequantize_row(int type, const uint8_t *row, int64_t k, float *out);

/* Row `r` of a matrix of `rows` rows as floats, whatever its layout (interleaved types keep no row
 * together). */
void llorch_matrix_row(int type, const uint8_t *data, int64_t rows, int64_t k, int64_t r, float *out);

/* Interleaved layouts (repack.c): the type a matrix of `rows` rows of file type `type` is
 * best read in by these kernels (itself where none is faster), the bytes of one 8-row group
 * of a block (0 for a file type), and the rearrangement (src and dst must not overlap). */
int llorch_repacked_type(int type, int64_t rows);
/* Inline: the kernels ask it for every chunk of rows, and with their type known it folds to a constant. */
static inline int64_t llorch_group_bytes(int type) {
    switch (type) {
        case T_Q8_0_R8: return 8 * 34;
        case T_Q5_0_R8: return 8 * 22;
        case T_Q4_K_R8: return 8 * 144;
        case T_Q6_K_R8: return 8 * 210;
        default: return 0;
    }
}
int llorch_repack(int type, uint8_t *data, int64_t rows, int64_t k);

/* An interleaved matrix lies in segments of SEGMENT values of every row (the last one shorter where
 * k is not a multiple): segment after segment, each its groups of eight rows one after another, each
 * group its blocks; a matrix of SEGMENT values or fewer is one segment. Why: decoding goes through a
 * matrix a segment at a time across all its rows (matmul.c), which reads the weights in one forward
 * run as before, while the part of the activations that each group reads stays in the L1 cache
 * beside them. Across all of k, every group pair streamed 18-50 KB of weights through L1 between two
 * reads of the same activations, and a thread read memory slower. Measured decoding's products from
 * memory (one thread, Zen 4, the same bytes in both layouts, alternating with a read probe): Q4_K
 * 2048 x 5632 at 0.85 -> 1.13 and 0.85 -> 0.99 of the probe, 5632 x 2048 0.88 -> 1.19, Q6_K
 * 2048 x 5632 0.64 -> 0.89 and 0.68 -> 1.16. */
#define SEGMENT 1024

/* The values of one block of an interleaved type: a K-quant super-block, or 32. */
static inline int64_t llorch_block_values(int type) { return type == T_Q4_K_R8 || type == T_Q6_K_R8 ? QK_K : QK; }

/* Where block b (of block_values values) of group g lies in an interleaved matrix of `groups` groups
 * of k values: bytes from its start. */
static inline int64_t llorch_block_at(int64_t group_bytes, int64_t block_values, int64_t groups, int64_t k,
                                      int64_t g, int64_t b) {
    const int64_t per = SEGMENT / block_values, blocks = k / block_values, segment = b / per;
    const int64_t here = blocks - segment * per < per ? blocks - segment * per : per;
    return (segment * per * groups + g * here + b % per) * group_bytes;
}

/* Their kernels (interleaved.c): the weight rows of groups ga and gb (eight rows each; gb == ga
 * for a group computed alone) of a matrix of k values (one segment, or a matrix of one) against
 * `tile` (1..4, or INTERLEAVED_TILE) activation rows, into out[t * ldo + j]; `carry`: each output
 * goes on from the value out holds (the segments before), in the same order of operations as one
 * pass; `ahead`: the kernels ask for the bytes PREFETCH_AHEAD past what they read (simd.h) in both
 * groups' runs. */
#ifdef LLORCH_VNNI
#define INTERLEAVED_TILE 8 /* interleaved.c says why */
#else
#define INTERLEAVED_TILE 4 /* AVX2's sixteen registers hold no more (interleaved_avx2.c) */
#endif
void llorch_interleaved_groups(int type, const uint8_t *w, int64_t k, int64_t ga, int64_t gb,
                               const act_block *const *x, int tile, float *out, int64_t ldo, int carry,
                               int ahead);
#if defined(LLORCH_AVX2) && !defined(LLORCH_VNNI)
/* The same for `rows` activation rows (row i's blocks at x + i * stride, into out + i * ldo), each group's
 * weights unpacked once for all of them (interleaved_avx2.c says why), with llorch_interleaved_groups' bits.
 * The AVX2 kernels take that path from INTERLEAVED_WIDE_ROWS rows on (matmul.c). */
#define INTERLEAVED_WIDE_ROWS 9 /* three tiles: at eight rows (two) it was level (products 0.98-1.09x, eight clients 0.99x) */
void llorch_interleaved_wide(int type, const uint8_t *w, int64_t k, int64_t ga, int64_t gb, const act_block *x,
                             int64_t stride, int64_t rows, float *out, int64_t ldo, int carry, int ahead);
#endif

/* AMX (amx.c, the amx variant). Whether this process may use the tile registers (asked once), and
 * how many of m activation rows of a matrix of `type` the AMX kernel takes (a multiple of 16; 0 where
 * it takes none: too few rows, amx.c says why). It reads the activations regrouped by tile of 16
 * rows: q[tile][block][row][32], d and dsum [tile][block][row] (llorch_amx_pack_ws, inside a
 * parallel region), and computes groups ga and gb as llorch_interleaved_groups does, for `tiles`
 * tiles. *configured_k: the caller's record of this thread's tile configuration, 0 at the start of
 * each product. */
typedef struct {
    int8_t *q;
    float *d, *dsum;
} amx_acts;
int llorch_amx_ready(void);
int64_t llorch_amx_rows(int type, int64_t m);
void llorch_amx_pack_ws(const act_block *xq, int64_t tiles, int64_t blocks, const amx_acts *out);
void llorch_amx_groups(int type, const uint8_t *w, int64_t rows, int64_t k, int64_t ga, int64_t gb,
                       const amx_acts *x, int64_t tiles, float *out, int64_t ldo, int *configured_k);

/* AMX-BF16 (amx_bf16.c, the amx variant): a prompt's rows, weights and activations as bfloat16 with
 * float32 sums (not the 8-bit kernels' bits; the decoder gives it a prompt's own rows only). Whether it
 * takes every one of `mats` (interleaved types, tiles granted); how many uint16 values the packed
 * activations of m rows of k take; those rows packed (inside a parallel region); and the product of
 * the packed rows with each matrix into outs[i] ([m][rows of mats[i]]). */
int llorch_bf16_takes(const matrix *mats, int count);
int64_t llorch_bf16_acts_values(int64_t m, int64_t k);
void llorch_bf16_pack_ws(const float *x, int64_t m, int64_t k, uint16_t *out);
void llorch_bf16_matmul_ws(const matrix *mats, int count, const uint16_t *acts, int64_t m, float *const *outs);

/* The direct kernels (direct.c): weight rows [j0, j1) of a common block type against up to
 * four activation rows, decoded in registers, into out[t * ldo + j]; 0 for other types.
 * `ahead`: the first pass over these weight rows, so ask memory for the bytes that follow them
 * too (prefetch_ahead in simd.h); later passes find them in cache. */
int llorch_has_direct(int type);
int llorch_direct_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1, int64_t k,
                       const act_block *const *x, int tile, float *out, int64_t ldo, int ahead);

/* n floats as the float16 the KV cache holds (attention.c; the step writes its keys and values so). */
void llorch_to_fp16(const float *src, int64_t n, uint16_t *dst);

/* Attention (attention.c) of the `group` query heads sharing KV head g, for one row, over its
 * cached positions [first, last) (at most ATTN_CHUNK) of a float16 cache [slots, kv_heads, head_dim]: writes each head's
 * max score, weight sum and weighted values (not yet normalized) to part[group][head_dim + 2].
 * `scores` is scratch of group * ATTN_CHUNK floats. `from_memory`: the chunk's keys and values are
 * likely out of the cache (the first row of its sequence in a step), so ask for all of them first. */
void llorch_attend_chunk(const float *q_row, const uint16_t *keys, const uint16_t *values, int64_t g, int64_t group,
                         int64_t head_dim, int64_t kv_heads, float scale, const int64_t *slots, int64_t first,
                         int64_t last, float *scores, float *part, int from_memory);

/* The work item a thread takes after this one: KV head g over the positions [first, last) of slots. */
typedef struct {
    const int64_t *slots;
    int64_t g, first, last;
} attend_next;

/* llorch_attend_chunk over a cache of any layout: slot s's key of head g at keys + s * slot_stride +
 * g * head_stride (the step's: head_dim and kv_slots * head_dim); asking for the `next` item's keys and
 * values (into L2) a share at a time as this item computes, so that they arrive meanwhile (`next` NULL:
 * none). Same bits. */
void llorch_attend_chunk_then(const float *q_row, const uint16_t *keys, const uint16_t *values, int64_t g,
                              int64_t group, int64_t head_dim, int64_t slot_stride, int64_t head_stride, float scale,
                              const int64_t *slots, int64_t first, int64_t last, float *scores, float *part,
                              int from_memory, const attend_next *next);

/* Activation rows -> act_blocks (k a multiple of 32). */
void llorch_quantize_rows(const float *x, int64_t m, int64_t k, act_block *out);

/* out[i * n + j] = x[i] . w[j] for the m activation rows (as floats, and quantized into xq
 * for block types: m * k / 32 act_blocks the caller provides) against the n weight rows
 * of a GGUF-typed matrix, on `threads` threads. */
int llorch_matmul(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, act_block *xq,
                  int64_t m, float *out, int threads);
/* The same product as a prompt's rows get it in a step (llorch_bf16_matmul_ws); -2 where that kernel
 * does not take the matrix (then out is untouched), -1 when a buffer could not be allocated. */
int llorch_matmul_prompt(int type, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *out,
                         int threads);

/* Inside a parallel region the caller opened (every thread calls them; worksharing loops). */
void llorch_quantize_rows_ws(const float *x, int64_t m, int64_t k, act_block *out);
/* Each output row's largest value and its first index, as llorch_argmax_rows gives them, found by a product as it
 * writes the outputs: every thread keeps its own, max[t * stride + i] and at[t * stride + i] for row i (at -2
 * where it saw none, -1 where it saw a NaN), and llorch_best_join_ws joins them. */
typedef struct {
    float *max;
    int64_t *at;
    int64_t stride;
} row_best;

/* One thread's share of a decoding product's chunks, whose end the other threads take once their own is done
 * (matmul.c says why): a cache line per thread, zeroed before the parallel region opens and kept for all of it.
 * `range`: the product, the pass and the chunks its thread has left (matmul.c's range_word); only its thread
 * writes `products`, the count of products it began. */
typedef struct {
    _Alignas(64) uint64_t range;
    uint32_t products;
} chunk_share;

/* Several matrices sharing one input (q, k and v; gate and up), as one worksharing loop; `best` (NULL for none)
 * finds the first matrix's row_best, where that matrix is the only one. `shares` (NULL for none): one per thread
 * of the region, for the threads to even out a decoding product's end. */
void llorch_matmul_group_ws(const matrix *mats, int count, const float *x, const act_block *xq, int64_t m,
                            float *const *outs, const row_best *best, chunk_share *shares);
/* Tests: how many chunks threads have taken off other threads' shares (chunk_share) since the last call. */
int64_t llorch_take_chunks_taken(void);
/* out[i] = row i's argmax from the `teams` threads' row_best (a worksharing loop over the m rows). */
void llorch_best_join_ws(const row_best *best, int teams, int64_t m, int64_t *out);

#endif
