/* Checked allocation for the step, and the layouts of the structs Python fills (kernels/step.py).
 *
 * Every buffer a step allocates comes from llorch_alloc: a failure there fails that step
 * (the caller gets a status and the engine fails that step's jobs) instead of writing
 * through NULL and killing the worker. llorch_fail_allocations makes the next n
 * allocations fail, so tests can prove that path without exhausting the machine's memory.
 */
#include <stddef.h>
#include <stdlib.h>

#include "llorch.h"

static int failures_to_inject;
static int allocation_failed;

void *llorch_alloc(size_t bytes) {
    if (__atomic_load_n(&failures_to_inject, __ATOMIC_RELAXED) > 0 &&
        __atomic_sub_fetch(&failures_to_inject, 1, __ATOMIC_RELAXED) >= 0) {
        __atomic_store_n(&allocation_failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64 * (bytes == 0));
    if (p == NULL) __atomic_store_n(&allocation_failed, 1, __ATOMIC_RELAXED);
    return p;
}

void *llorch_grow(void **buffer, size_t *capacity, size_t bytes) {
    if (bytes > *capacity) {
        free(*buffer);
        *buffer = llorch_alloc(bytes);
        *capacity = *buffer ? bytes : 0;
    }
    return *buffer;
}

void llorch_fail_allocations(int count) { __atomic_store_n(&failures_to_inject, count, __ATOMIC_RELAXED); }

int llorch_take_allocation_failure(void) { return __atomic_exchange_n(&allocation_failed, 0, __ATOMIC_RELAXED); }

/* sizeof, then offsetof of each field in declaration order, for each struct the Python side mirrors. */
#define FIELD(type, name) out[n++] = (int64_t)offsetof(type, name)
int64_t llorch_struct_layout(int which, int64_t *out) {
    int64_t n = 0;
    switch (which) {
    case 0:
        out[n++] = sizeof(matrix);
        FIELD(matrix, type); FIELD(matrix, unused); FIELD(matrix, data); FIELD(matrix, rows); FIELD(matrix, cols);
        break;
    case 1:
        out[n++] = sizeof(layer_desc);
        FIELD(layer_desc, q); FIELD(layer_desc, k); FIELD(layer_desc, v); FIELD(layer_desc, o);
        FIELD(layer_desc, gate); FIELD(layer_desc, up); FIELD(layer_desc, down);
        FIELD(layer_desc, q_bias); FIELD(layer_desc, k_bias); FIELD(layer_desc, v_bias); FIELD(layer_desc, o_bias);
        FIELD(layer_desc, input_norm); FIELD(layer_desc, post_attn_norm); FIELD(layer_desc, pre_ffn_norm);
        FIELD(layer_desc, post_ffn_norm); FIELD(layer_desc, q_norm); FIELD(layer_desc, k_norm);
        FIELD(layer_desc, keys); FIELD(layer_desc, values); FIELD(layer_desc, window); FIELD(layer_desc, rope);
        FIELD(layer_desc, kv_slots);
        break;
    case 2:
        out[n++] = sizeof(model_desc);
        FIELD(model_desc, hidden); FIELD(model_desc, heads); FIELD(model_desc, kv_heads); FIELD(model_desc, head_dim);
        FIELD(model_desc, intermediate); FIELD(model_desc, vocab); FIELD(model_desc, layers);
        FIELD(model_desc, eps); FIELD(model_desc, attn_scale); FIELD(model_desc, embed_scale);
        FIELD(model_desc, logit_softcap); FIELD(model_desc, sandwich); FIELD(model_desc, activation);
        FIELD(model_desc, embed); FIELD(model_desc, final_norm); FIELD(model_desc, head); FIELD(model_desc, layer);
        FIELD(model_desc, inv_freq); FIELD(model_desc, rope_scaling);
        break;
    case 3:
        out[n++] = sizeof(step_desc);
        FIELD(step_desc, rows); FIELD(step_desc, tokens); FIELD(step_desc, positions); FIELD(step_desc, write_slots);
        FIELD(step_desc, slot_start); FIELD(step_desc, slots); FIELD(step_desc, logit_rows_count);
        FIELD(step_desc, logit_rows); FIELD(step_desc, logits); FIELD(step_desc, best); FIELD(step_desc, prompt_from);
        break;
    default:
        return -1;
    }
    return n;
}
