/* SentencePiece BPE merges recovered from a vocabulary (weights/merges.py says what and why).
 *
 * Why in C: numpy's hashed form of this took about 1 s of a first start on Gemma 3's 262k tokens
 * (1.2 million cuts); a hash table of the tokens answers every cut and ranks the 515k merges in
 * about 0.2 s. Used when the kernels are loaded already (set-up builds them); merges.py's numpy
 * form otherwise.
 *
 * Tokens are runs of code points: token t is code[starts[t] : starts[t] + lengths[t]], each token
 * once. Every cut of t whose two halves are tokens is a merge (left, right, t), ranked by t's
 * score (higher first), then the longer left half, the longer right half, and t's index.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double score;
    int32_t left_length, right_length, token, left, right;
} merge;

static uint64_t hash_span(const uint32_t *code, int64_t length) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a over the code points */
    for (int64_t i = 0; i < length; i++) h = (h ^ code[i]) * 0x100000001b3ull;
    return h;
}

typedef struct {
    int64_t mask;
    int32_t *slots; /* token index + 1; 0 is empty */
    const uint32_t *code;
    const int64_t *starts, *lengths;
} table;

static int32_t find(const table *T, const uint32_t *span, int64_t length) {
    for (int64_t at = (int64_t)(hash_span(span, length) & (uint64_t)T->mask);; at = (at + 1) & T->mask) {
        const int32_t slot = T->slots[at];
        if (slot == 0) return -1;
        const int32_t t = slot - 1;
        if (T->lengths[t] == length && memcmp(T->code + T->starts[t], span, (size_t)length * 4) == 0) return t;
    }
}

static int by_rank(const void *a, const void *b) {
    const merge *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    if (x->left_length != y->left_length) return x->left_length > y->left_length ? -1 : 1;
    if (x->right_length != y->right_length) return x->right_length > y->right_length ? -1 : 1;
    return (x->token > y->token) - (x->token < y->token);
}

/* The merges, best first, as (left, right, merged) token indexes into out[capacity][3]. Returns how many
 * there are (only the first `capacity` written: call again with room for all), -1 when their merged
 * tokens total more than `budget` code points, -2 when memory runs out. */
int64_t llorch_spm_merges(int64_t count, const uint32_t *code, const int64_t *starts, const int64_t *lengths,
                          const double *scores, int64_t budget, int32_t *out, int64_t capacity) {
    int64_t size = 16;
    while (size < 2 * count) size <<= 1;
    table T = {size - 1, calloc((size_t)size, sizeof(int32_t)), code, starts, lengths};
    int64_t room = 1024, found = 0, total = 0;
    merge *merges = malloc(sizeof(merge) * (size_t)room);
    if (T.slots == NULL || merges == NULL) {
        free(T.slots);
        free(merges);
        return -2;
    }
    for (int64_t t = 0; t < count; t++) {
        if (lengths[t] == 0) continue;
        int64_t at = (int64_t)(hash_span(code + starts[t], lengths[t]) & (uint64_t)T.mask);
        while (T.slots[at] != 0) at = (at + 1) & T.mask;
        T.slots[at] = (int32_t)(t + 1);
    }
    for (int64_t t = 0; t < count && total <= budget; t++) {
        const uint32_t *span = code + starts[t];
        for (int64_t cut = 1; cut < lengths[t]; cut++) {
            const int32_t left = find(&T, span, cut);
            if (left < 0) continue;
            const int32_t right = find(&T, span + cut, lengths[t] - cut);
            if (right < 0) continue;
            if (found == room) {
                merge *grown = realloc(merges, sizeof(merge) * (size_t)(room *= 2));
                if (grown == NULL) {
                    free(T.slots);
                    free(merges);
                    return -2;
                }
                merges = grown;
            }
            merges[found++] = (merge){scores[t], (int32_t)cut, (int32_t)(lengths[t] - cut), (int32_t)t, left, right};
            total += lengths[t];
        }
    }
    free(T.slots);
    if (total > budget) {
        free(merges);
        return -1;
    }
    qsort(merges, (size_t)found, sizeof(merge), by_rank);
    for (int64_t i = 0; i < found && i < capacity; i++) {
        out[3 * i] = merges[i].left;
        out[3 * i + 1] = merges[i].right;
        out[3 * i + 2] = merges[i].token;
    }
    free(merges);
    return found;
}
