/* A SentencePiece-style BPE tokenizer (byte fallback, U+2581 for a space), in C.
 *
 * Why our own: the same vocabulary as a `tokenizers` object takes 0.8 s and ~90 MB to
 * parse from its JSON on every start (262k tokens, 515k merges), longer than the rest
 * of a warm start. These tables load from flat arrays in tens of milliseconds and hold
 * a quarter of that memory. The algorithm is `tokenizers`' BPE step for step (merges
 * ranked per pair, lowest rank then leftmost first; the same stale-entry check), and
 * text is split on added tokens leftmost-longest first, as its added vocabulary does;
 * the tests hold it to that library on random text and ids.
 *
 * Python (weights/native_tokenizer.py) owns the arrays; a table keeps pointers to them.
 * Every function is reentrant: the HTTP threads encode while the engine thread decodes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SPACE_MARK "\xe2\x96\x81" /* U+2581, the visible space */

typedef struct {
    int32_t first_child, next_sibling, id;
    uint8_t byte;
} trie_node;

typedef struct {
    int64_t n;               /* ids 0..n-1 */
    const int64_t *offsets;  /* n+1: token i is blob[offsets[i]:offsets[i+1]] */
    const uint8_t *blob;
    const uint8_t *flags;    /* FLAG_* per id */
    const int16_t *bytevals; /* the byte a "<0xNN>" token stands for, else -1 */
    int prepend;             /* SentencePiece's dummy prefix: a U+2581 before every text segment */
    int32_t *vocab;          /* open addressing: token text -> id (-1: empty) */
    uint64_t vocab_mask;
    uint64_t *merge_keys;    /* (left << 32 | right) + 1; 0: empty */
    int32_t *merge_rank, *merge_new;
    uint64_t merge_mask;
    int32_t byte_ids[256];   /* "<0xNN>" for byte fallback */
    trie_node *trie;         /* added tokens; node 0 is the root */
    int64_t trie_len;
    int32_t root[256];       /* the root's child per first byte (-1: none), for a quick miss */
} llorch_tok;

enum { FLAG_HOLE = 1, FLAG_SPECIAL = 2 };

static uint64_t hash_bytes(const uint8_t *s, int64_t len) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (int64_t i = 0; i < len; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h;
}

static uint64_t hash_key(uint64_t x) { /* splitmix64's finalizer */
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t table_size(int64_t entries) {
    uint64_t size = 16;
    while (size < (uint64_t)entries * 2) size <<= 1;
    return size;
}

static int32_t vocab_find(const llorch_tok *t, const uint8_t *s, int64_t len) {
    for (uint64_t slot = hash_bytes(s, len) & t->vocab_mask;; slot = (slot + 1) & t->vocab_mask) {
        int32_t id = t->vocab[slot];
        if (id < 0) return -1;
        int64_t start = t->offsets[id];
        if (t->offsets[id + 1] - start == len && memcmp(t->blob + start, s, (size_t)len) == 0) return id;
    }
}

static int merge_find(const llorch_tok *t, int32_t left, int32_t right, int32_t *rank, int32_t *new_id) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32 | (uint32_t)right) + 1;
    for (uint64_t slot = hash_key(key) & t->merge_mask;; slot = (slot + 1) & t->merge_mask) {
        if (t->merge_keys[slot] == 0) return 0;
        if (t->merge_keys[slot] == key) {
            *rank = t->merge_rank[slot];
            *new_id = t->merge_new[slot];
            return 1;
        }
    }
}

void llorch_tok_free(llorch_tok *t) {
    if (!t) return;
    free(t->vocab); free(t->merge_keys); free(t->merge_rank); free(t->merge_new); free(t->trie);
    free(t);
}

/* merges: (left, right, merged) id triples, best first; a later duplicate pair replaces an earlier one,
 * as the library's merge map does. added: ids of tokens matched whole in the text before it is split. */
llorch_tok *llorch_tok_new(int64_t n, const int64_t *offsets, const uint8_t *blob, const uint8_t *flags,
                           const int16_t *bytevals, const int32_t *merges, int64_t n_merges,
                           const int32_t *added, int64_t n_added, int prepend) {
    llorch_tok *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->n = n; t->offsets = offsets; t->blob = blob; t->flags = flags; t->bytevals = bytevals;
    t->prepend = prepend;
    uint64_t vsize = table_size(n), msize = table_size(n_merges);
    int64_t trie_cap = 1;
    for (int64_t i = 0; i < n_added; i++) trie_cap += offsets[added[i] + 1] - offsets[added[i]];
    t->vocab = malloc(vsize * sizeof *t->vocab);
    t->merge_keys = calloc(msize, sizeof *t->merge_keys);
    t->merge_rank = malloc(msize * sizeof *t->merge_rank);
    t->merge_new = malloc(msize * sizeof *t->merge_new);
    t->trie = malloc((size_t)trie_cap * sizeof *t->trie);
    if (!t->vocab || !t->merge_keys || !t->merge_rank || !t->merge_new || !t->trie) {
        llorch_tok_free(t);
        return NULL;
    }
    t->vocab_mask = vsize - 1;
    t->merge_mask = msize - 1;
    memset(t->vocab, 0xff, vsize * sizeof *t->vocab);
    for (int64_t id = 0; id < n; id++) {
        if (flags[id] & FLAG_HOLE) continue;
        const uint8_t *s = blob + offsets[id];
        int64_t len = offsets[id + 1] - offsets[id];
        uint64_t slot = hash_bytes(s, len) & t->vocab_mask;
        while (t->vocab[slot] >= 0) slot = (slot + 1) & t->vocab_mask; /* texts are unique: Python checks */
        t->vocab[slot] = (int32_t)id;
    }
    for (int64_t i = 0; i < n_merges; i++) {
        const int32_t *m = merges + 3 * i;
        uint64_t key = ((uint64_t)(uint32_t)m[0] << 32 | (uint32_t)m[1]) + 1;
        uint64_t slot = hash_key(key) & t->merge_mask;
        while (t->merge_keys[slot] != 0 && t->merge_keys[slot] != key) slot = (slot + 1) & t->merge_mask;
        t->merge_keys[slot] = key;
        t->merge_rank[slot] = (int32_t)i;
        t->merge_new[slot] = m[2];
    }
    for (int b = 0; b < 256; b++) {
        static const char hex[] = "0123456789ABCDEF";
        uint8_t name[6] = {'<', '0', 'x', (uint8_t)hex[b >> 4], (uint8_t)hex[b & 15], '>'};
        t->byte_ids[b] = vocab_find(t, name, 6);
    }
    memset(t->root, 0xff, sizeof t->root);
    t->trie[0] = (trie_node){-1, -1, -1, 0};
    t->trie_len = 1;
    for (int64_t i = 0; i < n_added; i++) {
        const uint8_t *s = blob + offsets[added[i]];
        int64_t len = offsets[added[i] + 1] - offsets[added[i]];
        int32_t node = 0;
        for (int64_t k = 0; k < len; k++) {
            int32_t child = node == 0 ? t->root[s[k]] : t->trie[node].first_child;
            if (node != 0)
                while (child >= 0 && t->trie[child].byte != s[k]) child = t->trie[child].next_sibling;
            if (child < 0) {
                child = (int32_t)t->trie_len++;
                t->trie[child] = (trie_node){-1, -1, -1, s[k]};
                if (node == 0) {
                    t->root[s[k]] = child;
                } else {
                    t->trie[child].next_sibling = t->trie[node].first_child;
                    t->trie[node].first_child = child;
                }
            }
            node = child;
        }
        if (node != 0) t->trie[node].id = added[i];
    }
    return t;
}

int64_t llorch_tok_lookup(const llorch_tok *t, const uint8_t *text, int64_t len) {
    return vocab_find(t, text, len);
}

/* The longest added token at text[0:len), its id in *id; 0 when none starts there. */
static int64_t added_match(const llorch_tok *t, const uint8_t *text, int64_t len, int32_t *id) {
    int64_t best = 0;
    int32_t node = t->root[text[0]];
    for (int64_t k = 1; node >= 0; k++) {
        if (t->trie[node].id >= 0) { best = k; *id = t->trie[node].id; }
        if (k == len) break;
        int32_t child = t->trie[node].first_child;
        while (child >= 0 && t->trie[child].byte != text[k]) child = t->trie[child].next_sibling;
        node = child;
    }
    return best;
}

typedef struct { int32_t rank, pos, new_id; } merge_entry;

static int before(merge_entry a, merge_entry b) { return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos; }

static void heap_push(merge_entry *heap, int64_t *size, merge_entry e) {
    int64_t i = (*size)++;
    while (i > 0 && before(e, heap[(i - 1) / 2])) { heap[i] = heap[(i - 1) / 2]; i = (i - 1) / 2; }
    heap[i] = e;
}

static merge_entry heap_pop(merge_entry *heap, int64_t *size) {
    merge_entry top = heap[0], last = heap[--*size];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= *size) break;
        if (child + 1 < *size && before(heap[child + 1], heap[child])) child++;
        if (!before(heap[child], last)) break;
        heap[i] = heap[child];
        i = child;
    }
    heap[i] = last;
    return top;
}

static int64_t utf8_len(uint8_t lead) { return lead < 0xc0 ? 1 : lead < 0xe0 ? 2 : lead < 0xf0 ? 3 : 4; }

/* One normalized piece of text (valid UTF-8) to ids: a symbol per character (or per byte, through
 * the byte tokens, for a character outside the vocabulary), then merges until none applies. */
static int64_t bpe(const llorch_tok *t, const uint8_t *s, int64_t len, int32_t *out, int32_t *c, int32_t *prev,
                   int32_t *next, int32_t *size, merge_entry *heap) {
    int64_t count = 0;
    for (int64_t i = 0; i < len;) {
        int64_t cl = utf8_len(s[i]);
        if (i + cl > len) cl = len - i;
        int32_t id = vocab_find(t, s + i, cl);
        if (id >= 0) {
            c[count] = id; size[count++] = (int32_t)cl;
        } else {
            for (int64_t k = 0; k < cl; k++) { c[count] = t->byte_ids[s[i + k]]; size[count++] = 1; }
        }
        i += cl;
    }
    for (int64_t i = 0; i < count; i++) { prev[i] = (int32_t)i - 1; next[i] = i + 1 < count ? (int32_t)i + 1 : -1; }
    int64_t heap_size = 0;
    int32_t rank, new_id;
    for (int64_t i = 0; i + 1 < count; i++)
        if (merge_find(t, c[i], c[i + 1], &rank, &new_id)) heap_push(heap, &heap_size, (merge_entry){rank, (int32_t)i, new_id});
    while (heap_size > 0) {
        merge_entry top = heap_pop(heap, &heap_size);
        int32_t pos = top.pos;
        if (size[pos] == 0 || next[pos] < 0) continue;
        int32_t right = next[pos];
        if (!merge_find(t, c[pos], c[right], &rank, &new_id) || new_id != top.new_id) continue; /* stale */
        c[pos] = top.new_id;
        size[pos] += size[right];
        next[pos] = next[right];
        size[right] = 0;
        if (next[right] >= 0) prev[next[right]] = pos;
        if (prev[pos] >= 0 && merge_find(t, c[prev[pos]], c[pos], &rank, &new_id))
            heap_push(heap, &heap_size, (merge_entry){rank, prev[pos], new_id});
        if (next[pos] >= 0 && merge_find(t, c[pos], c[next[pos]], &rank, &new_id))
            heap_push(heap, &heap_size, (merge_entry){rank, pos, new_id});
    }
    int64_t written = 0;
    for (int64_t i = 0; i < count; i++)
        if (size[i] != 0) out[written++] = c[i];
    return written;
}

/* Text (UTF-8) to ids, without BOS; `out` holds at least 2 * len + 1 ids. -1 when memory runs out. */
int64_t llorch_tok_encode(const llorch_tok *t, const uint8_t *text, int64_t len, int32_t *out) {
    /* A piece of len bytes normalizes to at most 3 * len + 3 bytes, each at most one symbol. */
    int64_t cap = 3 * len + 3;
    uint8_t *norm = malloc((size_t)cap);
    int32_t *c = malloc((size_t)cap * sizeof *c), *prev = malloc((size_t)cap * sizeof *prev);
    int32_t *next = malloc((size_t)cap * sizeof *next);
    int32_t *size = malloc((size_t)cap * sizeof *size);
    merge_entry *heap = malloc((size_t)cap * 3 * sizeof *heap); /* pairs, plus two per merge */
    int64_t written = 0;
    if (!norm || !c || !prev || !next || !size || !heap) {
        written = -1;
        goto done;
    }
    for (int64_t start = 0, i = 0; i <= len;) {
        int32_t id = -1;
        int64_t matched = i < len ? added_match(t, text + i, len - i, &id) : 0;
        if (matched == 0 && i < len) { i++; continue; }
        if (i > start) { /* the text before this added token (or the end) */
            int64_t m = 0;
            if (t->prepend) { memcpy(norm, SPACE_MARK, 3); m = 3; }
            for (int64_t k = start; k < i; k++) {
                if (text[k] == ' ') { memcpy(norm + m, SPACE_MARK, 3); m += 3; }
                else norm[m++] = text[k];
            }
            written += bpe(t, norm, m, out + written, c, prev, next, size, heap);
        }
        if (matched == 0) break; /* the end */
        out[written++] = id;
        i += matched;
        start = i;
    }
done:
    free(norm); free(c); free(prev); free(next); free(size); free(heap);
    return written;
}

/* Rust's str::from_utf8: shortest forms only, no surrogates, nothing past U+10FFFF. */
static int valid_utf8(const uint8_t *s, int64_t len) {
    for (int64_t i = 0; i < len;) {
        uint8_t b = s[i];
        if (b < 0x80) { i++; continue; }
        int64_t need = (b >= 0xc2 && b <= 0xdf) ? 1 : (b >= 0xe0 && b <= 0xef) ? 2 : (b >= 0xf0 && b <= 0xf4) ? 3 : 0;
        if (need == 0 || i + need >= len) return 0; /* not a lead byte, or the character is cut off */
        for (int64_t k = 1; k <= need; k++)
            if ((s[i + k] & 0xc0) != 0x80) return 0;
        if ((b == 0xe0 && s[i + 1] < 0xa0) || (b == 0xed && s[i + 1] > 0x9f) ||
            (b == 0xf0 && s[i + 1] < 0x90) || (b == 0xf4 && s[i + 1] > 0x8f))
            return 0;
        i += need + 1;
    }
    return 1;
}

/* A run of byte tokens: its bytes when they are UTF-8, else U+FFFD for each byte. */
static int64_t flush_bytes(const uint8_t *run, int64_t count, uint8_t *out, int64_t at, int64_t cap) {
    if (valid_utf8(run, count)) {
        if (at + count <= cap) memcpy(out + at, run, (size_t)count);
        return at + count;
    }
    for (int64_t k = 0; k < count; k++, at += 3)
        if (at + 3 <= cap) memcpy(out + at, "\xef\xbf\xbd", 3);
    return at;
}

/* Ids to UTF-8 text: unknown ids dropped, special ones too when asked, U+2581 read as a space, runs of
 * byte tokens joined into characters. Returns the length; the text is written only when it fits `cap`. */
int64_t llorch_tok_decode(const llorch_tok *t, const int64_t *ids, int64_t n, int skip_special, uint8_t *out,
                          int64_t cap) {
    int64_t at = 0, pending = 0;
    uint8_t *run = malloc((size_t)(n > 0 ? n : 1));
    if (!run) return -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t id = ids[i];
        if (id < 0 || id >= t->n || (t->flags[id] & FLAG_HOLE)) continue;
        if (skip_special && (t->flags[id] & FLAG_SPECIAL)) continue;
        if (t->bytevals[id] >= 0) { run[pending++] = (uint8_t)t->bytevals[id]; continue; }
        if (pending) { at = flush_bytes(run, pending, out, at, cap); pending = 0; }
        const uint8_t *s = t->blob + t->offsets[id];
        int64_t len = t->offsets[id + 1] - t->offsets[id];
        for (int64_t k = 0; k < len;) {
            if (k + 3 <= len && memcmp(s + k, SPACE_MARK, 3) == 0) {
                if (at < cap) out[at] = ' ';
                at++; k += 3;
            } else {
                if (at < cap) out[at] = s[k];
                at++; k++;
            }
        }
    }
    if (pending) at = flush_bytes(run, pending, out, at, cap);
    free(run);
    return at;
}
