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

static inline int is_block_type(int type) { return type != T_F32 && type != T_F16 && type != T_BF16; }

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* outs[i] = x . mats[i] for `m` rows of `k` values (worksharing): x is quantized first when
 * any of the matrices is a block type. Rows from `prompt_from` on are a prompt's own: where the
 * bfloat16 tile kernel takes every matrix (amx_bf16.c), it computes them, from xb. */
static void project(const matrix *mats, int count, const float *x, int64_t m, int64_t k, act_block *xq,
                    uint16_t *xb, int64_t prompt_from, float *const *outs, int phase) {
    const int64_t split = xb != NULL && prompt_from < m && llorch_bf16_takes(mats, count) ? prompt_from : m;
    for (int i = 0; i < count && split > 0; i++) {
        if (is_block_type(mats[i].type)) {
            llorch_quantize_rows_ws(x, split, k, xq);
            break;
        }
    }
    PROFILE(PH_QUANTIZE);
    if (split > 0) llorch_matmul_group_ws(mats, count, x, xq, split, outs);
    if (split < m) {
        float *shifted[3];
        for (int i = 0; i < count; i++) shifted[i] = outs[i] + split * mats[i].rows;
        llorch_bf16_pack_ws(x + split * k, m - split, k, xb);
        llorch_bf16_matmul_ws(mats, count, xb, m - split, shifted);
    }
    PROFILE(phase);
    (void)phase;
}

/* Each logits row's argmax, read while the step's threads are up: every thread scans a share of
 * every row (the rows were just written; most of them have left the cache for the weights read
 * since), then each row's shares are joined in order, so the first of equal values wins, and a
 * NaN anywhere gives -1 as llorch_argmax_rows does. On its own, after the step, this read was
 * one thread's 0.17 ms a token on the default model's 262k vocabulary. Called inside the step's
 * parallel region (its worksharing loops end in barriers). */
static void best_rows(const step_desc *S, int64_t vocab, int teams, float *span_max, int64_t *span_at) {
    const int64_t wanted = S->logit_rows_count, span = (vocab + teams - 1) / teams;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t item = 0; item < wanted * teams; item++) {
        const int64_t first = item % teams * span, n = first + span < vocab ? span : vocab - first;
        const int64_t at = n > 0 ? llorch_argmax_span(S->logits + item / teams * vocab + first, n, span_max + item) : -2;
        span_at[item] = at >= 0 ? first + at : at; /* -2: an empty share */
    }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t r = 0; r < wanted; r++) {
        int64_t at = -2;
        float max = 0.0f;
        for (int64_t t = r * teams; t < (r + 1) * teams && at != -1; t++) {
            if (span_at[t] == -2) continue;
            if (span_at[t] == -1 || at == -2 || span_max[t] > max) {
                at = span_at[t];
                max = span_max[t];
            }
        }
        S->best[r] = at;
    }
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
    const int64_t prompt_rows = S->prompt_from < R ? R - S->prompt_from : 0;
    const int64_t xb_values = prompt_rows > 0 ? llorch_bf16_acts_values(prompt_rows, widest) : 0;
    uint16_t *xb = xb_values > 0 ? llorch_alloc(sizeof(uint16_t) * (size_t)xb_values) : NULL;
    float *all_scores = llorch_alloc(sizeof(float) * (size_t)(teams * group * ATTN_CHUNK));
    const int64_t spans = S->logit_rows_count * teams;
    float *best_max = llorch_alloc(sizeof(float) * (size_t)(spans > 0 ? spans : 1));
    int64_t *best_at = llorch_alloc(sizeof(int64_t) * (size_t)(spans > 0 ? spans : 1));
    void *buffers[] = {x, h, q, k, v, attn, o, gate, up, parts, xq, rope_tables, all_scores, best_max, best_at, xb};
    const int count = (int)(sizeof(buffers) / sizeof(buffers[0]));
    int missing = xb_values > 0 && xb == NULL;
    for (int i = 0; i < count - 1; i++) missing |= buffers[i] == NULL;
    if (missing) {
        for (int i = 0; i < count; i++) free(buffers[i]);
        llorch_take_allocation_failure();
        return -1;
    }

#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#ifdef _OPENMP
        float *scores = all_scores + (int64_t)omp_get_thread_num() * group * ATTN_CHUNK;
#else
        float *scores = all_scores;
#endif
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

        /* token embeddings */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < R; r++) {
            const matrix *E = M->embed;
            llorch_matrix_row(E->type, E->data, H, S->tokens[r], x + r * H);
            if (M->embed_scale != 0.0f) for (int64_t i = 0; i < H; i++) x[r * H + i] *= M->embed_scale;
        }

        PROFILE(PH_SETUP);
        for (int64_t l = 0; l < M->layers; l++) {
            const layer_desc *L = M->layer + l;
            const float *cos_table = rope_tables + (int64_t)(2 * L->rope) * R * HD;
            const float *sin_table = rope_tables + (int64_t)(2 * L->rope + 1) * R * HD;

            /* attention input: norm, then q, k, v in one worksharing loop */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t r = 0; r < R; r++) rms_norm(x + r * H, L->input_norm, H, M->eps, h + r * H);
            PROFILE(PH_NORM);
            const matrix qkv[3] = {L->q, L->k, L->v};
            float *qkv_out[3] = {q, k, v};
            project(qkv, 3, h, R, H, xq, xb, S->prompt_from, qkv_out, PH_QKV);

            /* biases, per-head norms, RoPE, and the new keys and values into the cache */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t r = 0; r < R; r++) {
                float *qr = q + r * NQ, *kr = k + r * NKV, *vr = v + r * NKV;
                for (int64_t i = 0; L->q_bias && i < NQ; i++) qr[i] += L->q_bias[i];
                for (int64_t i = 0; L->k_bias && i < NKV; i++) kr[i] += L->k_bias[i];
                for (int64_t i = 0; L->v_bias && i < NKV; i++) vr[i] += L->v_bias[i];
                if (L->q_norm) {
                    for (int64_t hh = 0; hh < M->heads; hh++) rms_norm(qr + hh * HD, L->q_norm, HD, M->eps, qr + hh * HD);
                    for (int64_t hh = 0; hh < M->kv_heads; hh++) rms_norm(kr + hh * HD, L->k_norm, HD, M->eps, kr + hh * HD);
                }
                rope(qr, M->heads, HD, cos_table + r * HD, sin_table + r * HD);
                rope(kr, M->kv_heads, HD, cos_table + r * HD, sin_table + r * HD);
                store_fp16(L->keys + S->write_slots[r] * NKV, kr, NKV);
                store_fp16(L->values + S->write_slots[r] * NKV, vr, NKV);
            }
            PROFILE(PH_ROPE_CACHE);

            /* attention: each row over its own visible positions, in fixed chunks of keys */
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (int64_t item = 0; item < items; item++) {
                const int64_t r = item / (M->kv_heads * max_chunks), g = item / max_chunks % M->kv_heads;
                const int64_t c = item % max_chunks, position = S->positions[r];
                const int64_t lowest = L->window > 0 && position + 1 > L->window ? position + 1 - L->window : 0;
                const int64_t first = lowest + c * ATTN_CHUNK, last = first + ATTN_CHUNK < position + 1
                                                                          ? first + ATTN_CHUNK : position + 1;
                if (first >= last) continue;
                /* its sequence's first row in the step reads the keys and values from memory; the rows
                 * after it (a prompt chunk's, speculative decoding's drafts) find them in the cache */
                const int first_row = r == 0 || S->slot_start[r - 1] != S->slot_start[r];
                llorch_attend_chunk(q + r * NQ, L->keys, L->values, g, group, HD, M->kv_heads, M->attn_scale,
                                    S->slots + S->slot_start[r], first, last, scores, parts + item * part_size,
                                    first_row);
            }
            PROFILE(PH_ATTEND);
            /* combine each head's chunks: the softmax over all its visible positions */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t rh = 0; rh < R * M->heads; rh++) {
                const int64_t r = rh / M->heads, head = rh % M->heads, g = head / group, within = head % group;
                const int64_t position = S->positions[r];
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
            }
            PROFILE(PH_COMBINE);

            /* output projection and the residual */
            project(&L->o, 1, attn, R, NQ, xq, xb, S->prompt_from, &o, PH_O);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t r = 0; r < R; r++) {
                float *xr = x + r * H, *orow = o + r * H;
                for (int64_t i = 0; L->o_bias && i < H; i++) orow[i] += L->o_bias[i];
                if (M->sandwich) {
                    rms_norm(orow, L->post_attn_norm, H, M->eps, orow);
                    for (int64_t i = 0; i < H; i++) xr[i] += orow[i];
                    rms_norm(xr, L->pre_ffn_norm, H, M->eps, h + r * H);
                } else {
                    for (int64_t i = 0; i < H; i++) xr[i] += orow[i];
                    rms_norm(xr, L->post_attn_norm, H, M->eps, h + r * H);
                }
            }
            PROFILE(PH_RESIDUAL);

            /* the MLP */
            const matrix gate_up[2] = {L->gate, L->up};
            float *gate_up_out[2] = {gate, up};
            project(gate_up, 2, h, R, H, xq, xb, S->prompt_from, gate_up_out, PH_GATE_UP);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t r = 0; r < R; r++) {  /* h was consumed by gate/up: it takes the activations */
                float *g_row = gate + r * I, *u_row = up + r * I, *a_row = h + r * I;
                int64_t i = 0;
#if defined(LLORCH_AVX2) && !defined(__AVX512F__)
                i = v_gated8(g_row, u_row, I, M->activation == 1, a_row);
#endif
                if (M->activation == 1) {
                    for (; i < I; i++) a_row[i] = v_gelu_tanh(g_row[i]) * u_row[i];
                } else {
                    for (; i < I; i++) a_row[i] = v_silu(g_row[i]) * u_row[i];
                }
            }
            PROFILE(PH_ACTIVATION);
            project(&L->down, 1, h, R, I, xq, xb, S->prompt_from, &o, PH_DOWN);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t r = 0; r < R; r++) {
                float *xr = x + r * H, *orow = o + r * H;
                if (M->sandwich) rms_norm(orow, L->post_ffn_norm, H, M->eps, orow);
                for (int64_t i = 0; i < H; i++) xr[i] += orow[i];
            }
            PROFILE(PH_RESIDUAL);
        }

        /* final norm and the vocabulary projection of the wanted rows */
        const int64_t wanted = S->logit_rows_count;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < wanted; i++) rms_norm(x + S->logit_rows[i] * H, M->final_norm, H, M->eps, h + i * H);
        PROFILE(PH_NORM);
        project(M->head, 1, h, wanted, H, xq, NULL, wanted, &S->logits, PH_HEAD);
        if (M->logit_softcap != 0.0f) {
            const float cap = M->logit_softcap;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t i = 0; i < wanted * M->vocab; i++) S->logits[i] = v_tanh(S->logits[i] / cap) * cap;
            PROFILE(PH_HEAD);
        }
        if (S->best) best_rows(S, M->vocab, teams, best_max, best_at);
    }
    for (int i = 0; i < count; i++) free(buffers[i]);
    return llorch_take_allocation_failure() ? -1 : 0;  /* a thread's scratch could not grow */
}
