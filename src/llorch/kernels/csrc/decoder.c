/* One forward step of the Llama-family decoder in C: every row of the step, every layer.
 *
 * A step's rows are new tokens of several sequences (one each for decoding sequences, a
 * chunk each for sequences reading their prompt). Each layer runs
 *     norm -> q, k, v -> (q/k norms) -> RoPE -> write k, v to the paged cache
 *     -> attention over each row's own cached positions -> o -> residual (sandwich norms)
 *     -> norm -> gate, up -> activation -> down -> residual (sandwich norm)
 * and the step ends with the final norm and the vocabulary projection of the rows whose
 * logits are wanted. The whole step is one OpenMP parallel region: each phase is a
 * worksharing loop, and the barriers between phases are the only synchronization.
 *
 * Why C and not torch ops: at decode sizes a step is some 500 small tensor operations
 * whose dispatch cost more than their arithmetic. Why one path for decode and prompt rows:
 * every row's arithmetic (its norms, its quantized activations, its attention) depends
 * on that row alone, in a fixed order, so a row gives the same bits alone or batched,
 * decoding or inside a prompt chunk.
 */
#include <math.h>
#include <stdlib.h>

#include "profile.h"
#include "simd.h"
#include "vmath.h"

#if defined(LLORCH_PROFILE) && defined(_OPENMP)
double llorch_phase_seconds[PH_COUNT];
double llorch_phase_clock;

/* The seconds spent in each phase (enum step_phase) since the last call, then zeroed. */
void llorch_profile_take(double *out) {
    for (int i = 0; i < PH_COUNT; i++) {
        out[i] = llorch_phase_seconds[i];
        llorch_phase_seconds[i] = 0.0;
    }
}
#endif

/* -- small vector helpers --------------------------------------------------------------------- */
/* out = x * w / sqrt(mean(x^2) + eps), in place allowed. */
static inline void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    const float inverse = 1.0f / sqrtf(dot_f32(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inverse * w[i];
}

/* Rotate each head's halves by the row's angles (cos/sin tables of head_dim entries). */
static inline void rope(float *x, int64_t heads, int64_t head_dim, const float *cos_row, const float *sin_row) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos_row[i] - b * sin_row[i];
            v[i + half] = b * cos_row[i + half] + a * sin_row[i + half];
        }
    }
}

#define SPAN 256 /* values of a row's activation per work item: whole blocks, and 8-value vectors */
_Static_assert(SPAN % QK == 0 && SPAN % 8 == 0, "a span is whole quantized blocks and whole vectors");

static inline int is_block_type(int type) { return type != T_F32 && type != T_F16 && type != T_BF16; }

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Where a product of these matrices splits its m rows: those before go through the 8-bit kernels,
 * those after, a prompt's own, through the bfloat16 tile kernel where it takes every matrix (amx_bf16.c). */
static int64_t bf16_split(const matrix *mats, int count, int64_t m, const uint16_t *xb, int64_t prompt_from) {
    return xb != NULL && prompt_from < m && llorch_bf16_takes(mats, count) ? prompt_from : m;
}

/* The rows of x that a product of these matrices reads quantized: those before the split, or none when
 * no matrix is a block type. */
static int64_t quantized_rows(const matrix *mats, int count, int64_t m, const uint16_t *xb, int64_t prompt_from) {
    for (int i = 0; i < count; i++)
        if (is_block_type(mats[i].type)) return bf16_split(mats, count, m, xb, prompt_from);
    return 0;
}

/* outs[i] = x . mats[i] for `m` rows of `k` values (worksharing), from xq where x's rows are read
 * quantized (quantized_rows): the phase that wrote x quantized each row in the same worksharing
 * loop, as it finished it. Why: a phase of its own cost a barrier, and for one decoding row one
 * thread's work while the other waited, four times a layer. Measured decoding one stream (two
 * threads, Zen 4, bench/step_profile.py, the two builds in turn): the phases outside the products
 * 0.64 -> 0.52 ms a token on the 1.1B file, 0.15 -> 0.11 on the default model (under 1% of a
 * step: decode rates alike within the host's noise). Rows from `prompt_from` on are a prompt's own:
 * where the bfloat16 tile kernel takes every matrix, it computes them, from xb. `best`: the row_best of a
 * product whose rows all go through the 8-bit kernels (the vocabulary projection, whose xb is NULL), or NULL.
 * `shares`: the region's chunk_share per thread. */
static void project(const matrix *mats, int count, const float *x, int64_t m, int64_t k, const act_block *xq,
                    uint16_t *xb, int64_t prompt_from, float *const *outs, int phase, const row_best *best,
                    chunk_share *shares) {
    const int64_t split = bf16_split(mats, count, m, xb, prompt_from);
    if (split > 0) llorch_matmul_group_ws(mats, count, x, xq, split, outs, best, shares);
    if (split < m) {
        float *shifted[3];
        for (int i = 0; i < count; i++) shifted[i] = outs[i] + split * mats[i].rows;
        llorch_bf16_pack_ws(x + split * k, m - split, k, xb);
        llorch_bf16_matmul_ws(mats, count, xb, m - split, shifted);
    }
    PROFILE(phase);
    (void)phase;
}

/* The rows of a layer's attention input that q, k and v read quantized. */
static int64_t attention_quantized(const layer_desc *L, int64_t m, const uint16_t *xb, int64_t prompt_from) {
    const matrix qkv[3] = {L->q, L->k, L->v};
    return quantized_rows(qkv, 3, m, xb, prompt_from);
}

/* Row r of a product's input (`k` values at row), quantized where the product reads it so. */
static inline void quantize_input(const float *row, int64_t r, int64_t k, int64_t quantized, act_block *xq) {
    if (r < quantized) llorch_quantize_rows(row, 1, k, xq + r * (k / QK));
}

/* Row r's input to a layer's attention: its norm into h_row, quantized where q, k and v read it so. */
static inline void attention_input(const model_desc *M, const layer_desc *L, const float *x_row, float *h_row,
                                   int64_t r, int64_t quantized, act_block *xq) {
    rms_norm(x_row, L->input_norm, M->hidden, M->eps, h_row);
    quantize_input(h_row, r, M->hidden, quantized, xq);
}

/* Each logits row's argmax, read while the step's threads are up, where the product does not find it (many rows,
 * or a soft cap after it, which can make unequal values equal): every thread scans a
 * share of every row (the rows were just written; most of them have left the cache for the weights read
 * since), then each row's shares are joined in order, so the first of equal values wins, and a
 * NaN anywhere gives -1 as llorch_argmax_rows does. On its own, after the step, this read was
 * one thread's 0.17 ms a token on the default model's 262k vocabulary. Called inside the step's
 * parallel region (its worksharing loops end in barriers). */
static void best_rows(const step_desc *S, int64_t vocab, int teams, const row_best *shares) {
    const int64_t wanted = S->logit_rows_count, span = (vocab + teams - 1) / teams;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t item = 0; item < wanted * teams; item++) {
        const int64_t first = item % teams * span, n = first + span < vocab ? span : vocab - first;
        const int64_t share = item % teams * shares->stride + item / teams;
        const int64_t at = n > 0 ? llorch_argmax_span(S->logits + item / teams * vocab + first, n,
                                                      shares->max + share) : -2;
        shares->at[share] = at >= 0 ? first + at : at; /* -2: an empty share */
    }
    llorch_best_join_ws(shares, teams, wanted, S->best);
}

/* Attention's work item of a step: row r, KV head g, over positions [first, last). */
typedef struct {
    int64_t r, g, first, last;
} work_item;

/* Work item `item` (chunk by chunk of ATTN_CHUNK from the row's lowest visible position); first == last where it
 * has none (a row's chunks past its position). */
static inline work_item item_span(const model_desc *M, const step_desc *S, const layer_desc *L, int64_t max_chunks,
                                  int64_t item) {
    work_item w = {item / (M->kv_heads * max_chunks), item / max_chunks % M->kv_heads, 0, 0};
    const int64_t c = item % max_chunks, position = S->positions[w.r];
    const int64_t lowest = L->window > 0 && position + 1 > L->window ? position + 1 - L->window : 0;
    w.first = lowest + c * ATTN_CHUNK;
    w.last = w.first + ATTN_CHUNK < position + 1 ? w.first + ATTN_CHUNK : position + 1;
    if (w.last < w.first) w.last = w.first;
    return w;
}

/* Whether row r is its sequence's first in the step: it reads the keys and values from memory; the rows after it
 * (a prompt chunk's, speculative decoding's drafts) find them in the cache. */
static inline int first_of_sequence(const step_desc *S, int64_t r) {
    return r == 0 || S->slot_start[r - 1] != S->slot_start[r];
}

/* The next value of a count the step's threads share (attention's work items, one count per layer). */
static inline int64_t claim(int64_t *count) {
    int64_t taken;
#ifdef _OPENMP
#pragma omp atomic capture
#endif
    taken = (*count)++;
    return taken;
}

/* Row r's residual after attention: its o row (with the bias, and normed where the norms sandwich) added to x_row,
 * then the MLP's input normed into h_row and quantized where gate and up read it so. `added` takes the o row's
 * changes: the o row itself, or a copy where other threads still read the row (a lone row's). */
static inline void attention_residual(const model_desc *M, const layer_desc *L, const float *o_row, float *added,
                                      float *x_row, float *h_row, int64_t r, int64_t quantized, act_block *xq) {
    const int64_t H = M->hidden;
    for (int64_t i = 0; added != o_row && i < H; i++) added[i] = o_row[i];
    for (int64_t i = 0; L->o_bias && i < H; i++) added[i] += L->o_bias[i];
    if (M->sandwich) {
        rms_norm(added, L->post_attn_norm, H, M->eps, added);
        for (int64_t i = 0; i < H; i++) x_row[i] += added[i];
        rms_norm(x_row, L->pre_ffn_norm, H, M->eps, h_row);
    } else {
        for (int64_t i = 0; i < H; i++) x_row[i] += added[i];
        rms_norm(x_row, L->post_attn_norm, H, M->eps, h_row);
    }
    quantize_input(h_row, r, H, quantized, xq);
}

/* Row r's residual after the MLP: its down row (normed where the norms sandwich) added to x_row; `added` as above. */
static inline void mlp_residual(const model_desc *M, const layer_desc *L, const float *down_row, float *added,
                                float *x_row) {
    const int64_t H = M->hidden;
    for (int64_t i = 0; added != down_row && i < H; i++) added[i] = down_row[i];
    if (M->sandwich) rms_norm(added, L->post_ffn_norm, H, M->eps, added);
    for (int64_t i = 0; i < H; i++) x_row[i] += added[i];
}

/* The rows of a step that are a prompt's own (from prompt_from on). */
static inline int64_t prompt_rows_of(const step_desc *S) {
    return S->prompt_from < S->rows ? S->rows - S->prompt_from : 0;
}

/* Token `token`'s embedding row, scaled where the model scales it. */
static inline void embed_row(const model_desc *M, int64_t token, float *out) {
    const matrix *E = M->embed;
    llorch_matrix_row(E->type, E->data, E->rows, M->hidden, token, out);
    if (M->embed_scale != 0.0f)
        for (int64_t i = 0; i < M->hidden; i++) out[i] *= M->embed_scale;
}

/* Row r's kv head g: the biases, per-head norms and RoPE of its query heads and of its key, and its key and value
 * into the cache. Every head's values depend on that head's alone, so a row's heads give the same bits
 * whichever thread takes them, in whatever order. */
static inline void group_heads(const model_desc *M, const step_desc *S, const layer_desc *L, int64_t r, int64_t g,
                               float *q, float *k, float *v, const float *cos_row, const float *sin_row) {
    const int64_t HD = M->head_dim, group = M->heads / M->kv_heads;
    const int64_t at_q = r * M->heads * HD + g * group * HD, at_kv = (r * M->kv_heads + g) * HD;
    float *qr = q + at_q, *kr = k + at_kv, *vr = v + at_kv;
    for (int64_t i = 0; L->q_bias && i < group * HD; i++) qr[i] += L->q_bias[g * group * HD + i];
    for (int64_t i = 0; L->k_bias && i < HD; i++) kr[i] += L->k_bias[g * HD + i];
    for (int64_t i = 0; L->v_bias && i < HD; i++) vr[i] += L->v_bias[g * HD + i];
    if (L->q_norm) {
        for (int64_t hh = 0; hh < group; hh++) rms_norm(qr + hh * HD, L->q_norm, HD, M->eps, qr + hh * HD);
        rms_norm(kr, L->k_norm, HD, M->eps, kr);
    }
    rope(qr, group, HD, cos_row, sin_row);
    rope(kr, 1, HD, cos_row, sin_row);
    /* the cache is [kv_heads, kv_slots, head_dim] */
    store_fp16(L->keys + (g * L->kv_slots + S->write_slots[r]) * HD, kr, HD);
    store_fp16(L->values + (g * L->kv_slots + S->write_slots[r]) * HD, vr, HD);
}

/* Query head `head` of row r: the softmax over all its visible positions, from its chunks' parts, into attn; quantized
 * there too where o reads it so and a head is whole blocks of the row's quantized form. */
static inline void combine_head(const model_desc *M, const step_desc *S, const layer_desc *L, const float *parts,
                                int64_t max_chunks, int64_t part_size, int64_t r, int64_t head, float *attn,
                                int quantize, act_block *xq) {
    const int64_t HD = M->head_dim, NQ = M->heads * HD, group = M->heads / M->kv_heads;
    const int64_t g = head / group, within = head % group, position = S->positions[r];
    const int64_t lowest = L->window > 0 && position + 1 > L->window ? position + 1 - L->window : 0;
    const int64_t chunks = (position - lowest) / ATTN_CHUNK + 1;
    const float *first = parts + ((r * M->kv_heads + g) * max_chunks) * part_size + within * (HD + 2);
    float best = -INFINITY;
    for (int64_t c = 0; c < chunks; c++) best = first[c * part_size] > best ? first[c * part_size] : best;
    float total = 0.0f;
    float *out = attn + r * NQ + head * HD;
    for (int64_t d = 0; d < HD; d++) out[d] = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        const float *part = first + c * part_size, weight = v_exp(part[0] - best);
        total += weight * part[1];
        for (int64_t d = 0; d < HD; d++) out[d] += weight * part[2 + d];
    }
    const float inverse = 1.0f / total;
    for (int64_t d = 0; d < HD; d++) out[d] *= inverse;
    if (quantize) llorch_quantize_rows(out, 1, HD, xq + (r * NQ + head * HD) / QK);
}

/* -- the step ------------------------------------------------------------------------------------ */
int llorch_decoder_forward(const model_desc *M, const step_desc *S, int threads) {
    const int64_t R = S->rows, H = M->hidden, HD = M->head_dim, NQ = M->heads * HD, NKV = M->kv_heads * HD;
    const int64_t I = M->intermediate, group = M->heads / M->kv_heads, widest = max64(max64(H, NQ), I);
    int64_t max_position = 0;
    for (int64_t r = 0; r < R; r++) max_position = max64(max_position, S->positions[r]);
    const int64_t max_chunks = max_position / ATTN_CHUNK + 1, part_size = group * (HD + 2);
    const int64_t items = R * M->kv_heads * max_chunks;
    const int teams = threads > 1 ? threads : 1;
    const int64_t activation_spans = (I + SPAN - 1) / SPAN;
    const int whole_heads = HD % QK == 0; /* a head's values are whole blocks of the quantized row */
    /* One decoding row alone (one stream): every thread keeps its own copy of the row's residual stream and
     * computes the norms after each residual itself, into its own input of the next product, and at short
     * context each thread's kv heads take their RoPE, cache writes, attention and softmax in one phase. Why:
     * each phase that one thread did for the row ended in a barrier and sent its output to the other
     * thread's cache; where the host puts the two threads on cores that share no cache, a barrier took some
     * 0.5 us and each line passed 0.4-0.7 us. A layer's barriers went from eleven to six. */
    const int lone = R == 1 && prompt_rows_of(S) == 0 && M->layers > 0;
    const int fused_attention = lone && max_chunks == 1;

    /* Every buffer up front, each checked: a failure fails this step, never the process. */
    float *x = llorch_alloc(sizeof(float) * (size_t)(R * H)), *h = llorch_alloc(sizeof(float) * (size_t)(R * widest));
    float *q = llorch_alloc(sizeof(float) * (size_t)(R * NQ)), *k = llorch_alloc(sizeof(float) * (size_t)(R * NKV));
    float *v = llorch_alloc(sizeof(float) * (size_t)(R * NKV));
    float *attn = llorch_alloc(sizeof(float) * (size_t)(R * NQ)), *o = llorch_alloc(sizeof(float) * (size_t)(R * H));
    float *gate = llorch_alloc(sizeof(float) * (size_t)(R * I)), *up = llorch_alloc(sizeof(float) * (size_t)(R * I));
    float *parts = llorch_alloc(sizeof(float) * (size_t)(items * part_size));
    act_block *xq = llorch_alloc(sizeof(act_block) * (size_t)(R * widest / QK));
    float *rope_tables = llorch_alloc(sizeof(float) * (size_t)(4 * R * HD));
    /* the prompt rows' activations as bfloat16 tiles, where a kernel reads them (amx_bf16.c) */
    const int64_t prompt_rows = prompt_rows_of(S);
    const int64_t xb_values = prompt_rows > 0 ? llorch_bf16_acts_values(prompt_rows, widest) : 0;
    uint16_t *xb = xb_values > 0 ? llorch_alloc(sizeof(uint16_t) * (size_t)xb_values) : NULL;
    float *all_scores = llorch_alloc(sizeof(float) * (size_t)(teams * group * ATTN_CHUNK));
    /* each thread's argmax of every logits row (row_best, each thread's rows a cache line's 16 apart): found by
     * the vocabulary projection, or by best_rows after it */
    const int64_t best_stride = (S->logit_rows_count + 15) / 16 * 16, spans = best_stride * teams;
    float *best_max = llorch_alloc(sizeof(float) * (size_t)(spans > 0 ? spans : 1));
    int64_t *best_at = llorch_alloc(sizeof(int64_t) * (size_t)(spans > 0 ? spans : 1));
    int64_t *claims = llorch_alloc(sizeof(int64_t) * (size_t)(M->layers > 0 ? M->layers : 1));
    /* a lone row's copies per thread: its residual stream, its norm, a scratch row, and the norm quantized */
    float *own_rows = llorch_alloc(sizeof(float) * (size_t)(lone ? teams * 3 * H : 1));
    act_block *own_blocks = llorch_alloc(sizeof(act_block) * (size_t)(lone ? teams * (H / QK + 1) : 1));
    chunk_share *shares = llorch_alloc(sizeof(chunk_share) * (size_t)teams);
    void *buffers[] = {x, h, q, k, v, attn, o, gate, up, parts, xq, rope_tables, all_scores, best_max, best_at, claims,
                       own_rows, own_blocks, shares, xb};
    const int count = (int)(sizeof(buffers) / sizeof(buffers[0]));
    int missing = xb_values > 0 && xb == NULL;
    for (int i = 0; i < count - 1; i++) missing |= buffers[i] == NULL;
    if (missing) {
        for (int i = 0; i < count; i++) free(buffers[i]);
        llorch_take_allocation_failure();
        return -1;
    }
    for (int64_t l = 0; l < M->layers; l++) claims[l] = 0;
    memset(shares, 0, sizeof(chunk_share) * (size_t)teams);
    for (int64_t i = 0; i < spans; i++) best_at[i] = -2; /* a thread the region does not start saw nothing */
    const row_best bests = {best_max, best_at, best_stride};
    /* The vocabulary projection finds each row's argmax as it writes the logits, where no soft cap changes them
     * after and the rows are few. Why: read after the step, the logits came back from memory, 40 us a token on
     * the default model; found by the product they are read in cache, but with a few instructions per row and
     * eight weight rows beside each kernel call, which a product of many rows (bound by computing) pays for:
     * measured decoding the default model (two threads, Zen 5, windows in turn), 1 / 2 / 4 / 8 streams
     * 0.995-1.004x / 1.008x / 0.995x / 1.02-1.04x, and found so for 16 / 32 streams too, 1.00x / 0.97-0.985x. */
    const int head_finds_best = S->best != NULL && M->logit_softcap == 0.0f && S->logit_rows_count <= 8;

    const int64_t first_quantized = M->layers > 0 ? attention_quantized(M->layer, R, xb, S->prompt_from) : 0;
    const int64_t head_quantized = quantized_rows(M->head, 1, S->logit_rows_count, NULL, S->logit_rows_count);
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num(), crew = omp_get_num_threads(); /* the threads the region has */
#else
        const int tid = 0, crew = 1;
#endif
        float *scores = all_scores + (int64_t)tid * group * ATTN_CHUNK;
        /* the row's residual stream, its norm (the next product's input), scratch, and the norm quantized: this
         * thread's own copies where the row is alone, else the step's shared rows */
        float *own_x = lone ? own_rows + (int64_t)tid * 3 * H : x, *own_h = lone ? own_x + H : h;
        float *own_scratch = own_x + 2 * H;
        act_block *own_xq = lone ? own_blocks + (int64_t)tid * (H / QK + 1) : xq;
        PROFILE_START();

        /* the RoPE angles of every row, per variant: cos and sin tables [variant][row][head_dim] */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < R; r++) {
            for (int var = 0; var < 2; var++) {
                float *cos_row = rope_tables + ((int64_t)(2 * var) * R + r) * HD;
                float *sin_row = rope_tables + ((int64_t)(2 * var + 1) * R + r) * HD;
                const float position = (float)S->positions[r] / M->rope_scaling[var];
                for (int64_t i = 0; i < HD / 2; i++) {
                    const float angle = position * M->inv_freq[var][i];
                    cos_row[i] = cos_row[i + HD / 2] = cosf(angle);
                    sin_row[i] = sin_row[i + HD / 2] = sinf(angle);
                }
            }
        }

        /* token embeddings, and the first layer's attention input (a lone row's by every thread, into its own) */
        if (lone) {
            embed_row(M, S->tokens[0], own_x);
            attention_input(M, M->layer, own_x, own_h, 0, first_quantized, own_xq);
        } else {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t r = 0; r < R; r++) {
                embed_row(M, S->tokens[r], x + r * H);
                if (M->layers > 0) attention_input(M, M->layer, x + r * H, h + r * H, r, first_quantized, xq);
            }
        }

        PROFILE(PH_SETUP);
        for (int64_t l = 0; l < M->layers; l++) {
            const layer_desc *L = M->layer + l;
            const float *cos_table = rope_tables + (int64_t)(2 * L->rope) * R * HD;
            const float *sin_table = rope_tables + (int64_t)(2 * L->rope + 1) * R * HD;
            const int64_t o_quantized = quantized_rows(&L->o, 1, R, xb, S->prompt_from);
            const matrix gate_up[2] = {L->gate, L->up};
            const int64_t gate_up_quantized = quantized_rows(gate_up, 2, R, xb, S->prompt_from);
            const int64_t down_quantized = quantized_rows(&L->down, 1, R, xb, S->prompt_from);
            const int64_t next_quantized = l + 1 < M->layers ? attention_quantized(L + 1, R, xb, S->prompt_from) : 0;

            /* q, k, v in one worksharing loop (their input was normed and quantized by the phase before) */
            const matrix qkv[3] = {L->q, L->k, L->v};
            float *qkv_out[3] = {q, k, v};
            project(qkv, 3, own_h, R, H, own_xq, xb, S->prompt_from, qkv_out, PH_QKV, NULL, shares);

            if (fused_attention) {
                /* a lone row at short context: each thread its kv heads, from RoPE to the softmax (one chunk of keys
                 * each, combined as below) */
                for (int64_t g = tid; g < M->kv_heads; g += crew) {
                    group_heads(M, S, L, 0, g, q, k, v, cos_table, sin_table);
                    const work_item w = item_span(M, S, L, 1, g);
                    llorch_attend_chunk_then(q, L->keys, L->values, g, group, HD, HD, L->kv_slots * HD, M->attn_scale,
                                             S->slots + S->slot_start[0], w.first, w.last, scores,
                                             parts + g * part_size, 1, NULL);
                    for (int64_t head = g * group; head < (g + 1) * group; head++)
                        combine_head(M, S, L, parts, 1, part_size, 0, head, attn, whole_heads && o_quantized > 0, xq);
                }
#ifdef _OPENMP
#pragma omp barrier
#endif
                if (!whole_heads) llorch_quantize_rows_ws(attn, o_quantized, NQ, xq);
                PROFILE(PH_ATTEND);
            } else {
                /* biases, per-head norms, RoPE, and the new keys and values into the cache */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
                for (int64_t r = 0; r < R; r++)
                    for (int64_t g = 0; g < M->kv_heads; g++)
                        group_heads(M, S, L, r, g, q, k, v, cos_table + r * HD, sin_table + r * HD);
                PROFILE(PH_ROPE_CACHE);

                /* attention: each row over its own visible positions, in fixed chunks of keys. Each thread takes
                 * one work item at a time (dynamic, as a shared count), and takes its next one before it computes
                 * this one, so that this one asks for the next one's keys and values as it goes (attention.c). */
                int64_t mine = claim(claims + l);
                work_item w = mine < items ? item_span(M, S, L, max_chunks, mine) : (work_item){0, 0, 0, 0};
                int asked = 0; /* whether `w`'s keys and values were asked for during the item before */
                while (mine < items) {
                    const int64_t next = claim(claims + l);
                    const work_item after =
                        next < items ? item_span(M, S, L, max_chunks, next) : (work_item){0, 0, 0, 0};
                    /* the next item's keys and values come from memory too: asked for as this one computes */
                    const int then = after.first < after.last && first_of_sequence(S, after.r);
                    const attend_next ahead = {S->slots + S->slot_start[after.r], after.g, after.first, after.last};
                    if (w.first < w.last)
                        llorch_attend_chunk_then(q + w.r * NQ, L->keys, L->values, w.g, group, HD, HD, L->kv_slots * HD,
                                                 M->attn_scale, S->slots + S->slot_start[w.r], w.first, w.last, scores,
                                                 parts + mine * part_size, first_of_sequence(S, w.r) && !asked,
                                                 then ? &ahead : NULL);
                    asked = then && w.first < w.last;
                    mine = next;
                    w = after;
                }
#ifdef _OPENMP
#pragma omp barrier
#endif
                PROFILE(PH_ATTEND);
                /* combine each head's chunks: the softmax over all its visible positions */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
                for (int64_t rh = 0; rh < R * M->heads; rh++) {
                    const int64_t r = rh / M->heads;
                    combine_head(M, S, L, parts, max_chunks, part_size, r, rh % M->heads, attn,
                                 whole_heads && r < o_quantized, xq);
                }
                if (!whole_heads) llorch_quantize_rows_ws(attn, o_quantized, NQ, xq);
                PROFILE(PH_COMBINE);
            }

            /* output projection and the residual, then the MLP's input normed and quantized */
            project(&L->o, 1, attn, R, NQ, xq, xb, S->prompt_from, &o, PH_O, NULL, shares);
            if (lone) {  /* by every thread, into its own copies: o is read, not written */
                attention_residual(M, L, o, own_scratch, own_x, own_h, 0, gate_up_quantized, own_xq);
            } else {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
                for (int64_t r = 0; r < R; r++)
                    attention_residual(M, L, o + r * H, o + r * H, x + r * H, h + r * H, r, gate_up_quantized, xq);
            }
            PROFILE(PH_RESIDUAL);

            /* the MLP */
            float *gate_up_out[2] = {gate, up};
            project(gate_up, 2, own_h, R, H, own_xq, xb, S->prompt_from, gate_up_out, PH_GATE_UP, NULL, shares);
            /* the activation in spans of each row, so that one decoding row's is shared by the threads;
             * each span quantized as it is done (whole blocks: SPAN is a multiple of 32) */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t item = 0; item < R * activation_spans; item++) {  /* h, read by gate and up, takes them */
                const int64_t r = item / activation_spans, first = item % activation_spans * SPAN;
                const int64_t n = first + SPAN < I ? SPAN : I - first;
                const float *g_span = gate + r * I + first, *u_span = up + r * I + first;
                float *a_span = h + r * I + first;
                int64_t i = 0;
#if defined(LLORCH_AVX2) && !defined(__AVX512F__)
                i = v_gated8(g_span, u_span, n, M->activation == 1, a_span);
#endif
                if (M->activation == 1) {
                    for (; i < n; i++) a_span[i] = v_gelu_tanh(g_span[i]) * u_span[i];
                } else {
                    for (; i < n; i++) a_span[i] = v_silu(g_span[i]) * u_span[i];
                }
                if (r < down_quantized) llorch_quantize_rows(a_span, 1, n, xq + (r * I + first) / QK);
            }
            PROFILE(PH_ACTIVATION);
            project(&L->down, 1, h, R, I, xq, xb, S->prompt_from, &o, PH_DOWN, NULL, shares);
            /* the residual, then the next layer's attention input normed and quantized */
            if (lone) {  /* by every thread, into its own copies */
                mlp_residual(M, L, o, own_scratch, own_x);
                if (l + 1 < M->layers) attention_input(M, L + 1, own_x, own_h, 0, next_quantized, own_xq);
            } else {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
                for (int64_t r = 0; r < R; r++) {
                    mlp_residual(M, L, o + r * H, o + r * H, x + r * H);
                    if (l + 1 < M->layers) attention_input(M, L + 1, x + r * H, h + r * H, r, next_quantized, xq);
                }
            }
            PROFILE(PH_RESIDUAL);
        }

        /* final norm and the vocabulary projection of the wanted rows */
        const int64_t wanted = S->logit_rows_count;
        if (lone) {
            if (wanted > 0) {
                rms_norm(own_x, M->final_norm, H, M->eps, own_h);
                quantize_input(own_h, 0, H, head_quantized, own_xq);
            }
        } else {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t i = 0; i < wanted; i++) {
                rms_norm(x + S->logit_rows[i] * H, M->final_norm, H, M->eps, h + i * H);
                quantize_input(h + i * H, i, H, head_quantized, xq);
            }
        }
        PROFILE(PH_NORM);
        project(M->head, 1, own_h, wanted, H, own_xq, NULL, wanted, &S->logits, PH_HEAD,
                head_finds_best ? &bests : NULL, shares);
        if (head_finds_best) llorch_best_join_ws(&bests, teams, wanted, S->best);
        if (M->logit_softcap != 0.0f) {
            const float cap = M->logit_softcap;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t i = 0; i < wanted * M->vocab; i++) S->logits[i] = v_tanh(S->logits[i] / cap) * cap;
            PROFILE(PH_HEAD);
        }
        if (S->best && !head_finds_best) best_rows(S, M->vocab, teams, &bests);
    }
    for (int i = 0; i < count; i++) free(buffers[i]);
    return llorch_take_allocation_failure() ? -1 : 0;  /* a thread's scratch could not grow */
}
