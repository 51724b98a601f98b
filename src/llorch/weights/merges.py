"""SentencePiece BPE merges recovered from a vocabulary, with numpy instead of a Python loop.

GGUF files of this kind carry no merge list: every way to split a token into two tokens
is a merge, ranked by the merged token's priority. Asking a dict about each of the 1.2
million cuts of Gemma 3's 262k tokens took about 2 s of a first start; here every cut's
two halves are hashed at once (a polynomial hash mod 2^64 over the vocabulary's code points,
the prefix-sum form), looked up among the tokens' own hashes, and each match is then compared
character by character, so the result is exact whatever the hash does. Should two tokens share
a hash (never seen; a file could be built for it), the plain loop decides instead. Where the C
kernels are loaded already (set-up builds them), csrc/merges.c finds and ranks the same merges
from a hash table of the tokens in about a fifth of numpy's time.
"""

from __future__ import annotations

import ctypes

import numpy as np

# Merges recovered from a SentencePiece vocabulary may total this many times its characters
# (the default model's give 2.1x).
MERGE_CHARS_PER_VOCAB_CHAR = 8
# Above this many characters (Gemma 3's vocabulary holds 1.5 million) the arrays, about 100 bytes a
# character, would cost more memory than the loop's time is worth: the loop decides.
MAX_VECTORIZED_CHARS = 4 << 20
_BASE = 0x9E3779B97F4A7C15  # odd, so it has an inverse mod 2^64


class TooManyMerges(ValueError):
    def __init__(self) -> None:
        super().__init__(f"the vocabulary splits into more merges than {MERGE_CHARS_PER_VOCAB_CHAR}x its own size; "
                         "it is not a SentencePiece vocabulary")


def merges_from_vocab(vocab: dict[str, int], priority: dict[str, float], lib: ctypes.CDLL | None = None
                      ) -> tuple[list[tuple[str, str]], np.ndarray]:
    """All (left, right) splits of each token whose halves are tokens, best merge first, and the same merges as
    (left, right, merged) ids [m, 3] (for the C tokenizer's tables). `lib`: the loaded kernels, whose C form
    (csrc/merges.c) is used; without them numpy's.

    Ties are ordered by longer left part, then longer right part, then vocabulary
    order of the merged token, matching the reference conversion.

    The merges' total length is bounded by MERGE_CHARS_PER_VOCAB_CHAR times the
    vocabulary's: a real vocabulary yields about twice its own size, while one built to
    split every way ("b", "bb", ... "b" x 2000) would yield a cubic amount.
    """
    tokens = list(priority)  # each token once, in the order that breaks the last ties
    count = len(tokens)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=count)
    chars = int(lengths.sum())
    if chars > MAX_VECTORIZED_CHARS and lib is None:
        return merges_by_loop(vocab, priority)
    budget = MERGE_CHARS_PER_VOCAB_CHAR * chars
    code = np.frombuffer("".join(tokens).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    starts = np.cumsum(lengths) - lengths
    scores = np.fromiter(priority.values(), dtype=np.float64, count=count)
    found = (_merges_in_c(lib, code, starts, lengths, scores, budget) if lib is not None
             else _merges_in_numpy(code, starts, lengths, scores, budget))
    if found is None:  # two tokens share a hash
        return merges_by_loop(vocab, priority)
    left, right, token = found
    ids = np.fromiter(map(vocab.__getitem__, tokens), dtype=np.int64, count=count)
    merge_ids = np.stack([ids[left], ids[right], ids[token]], axis=1).astype(np.int32)
    merges = list(zip(map(tokens.__getitem__, left.tolist()), map(tokens.__getitem__, right.tolist()), strict=True))
    return merges, merge_ids


def _merges_in_c(lib: ctypes.CDLL, code: np.ndarray, starts: np.ndarray, lengths: np.ndarray, scores: np.ndarray,
                 budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(left, right, merged) token indexes, ranked, from csrc/merges.c."""
    capacity = 2 * len(lengths) + 1024  # a real vocabulary's merges: about two a token
    while True:
        out = np.empty((capacity, 3), dtype=np.int32)
        found = lib.llorch_spm_merges(len(lengths), code.ctypes.data, starts.ctypes.data, lengths.ctypes.data,
                                      scores.ctypes.data, budget, out.ctypes.data, capacity)
        if found == -1:
            raise TooManyMerges()
        if found < 0:
            raise MemoryError("recovering the vocabulary's merges ran out of memory")
        if found <= capacity:
            return out[:found, 0], out[:found, 1], out[:found, 2]
        capacity = found


def _merges_in_numpy(code: np.ndarray, starts: np.ndarray, lengths: np.ndarray, scores: np.ndarray, budget: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(left, right, merged) token indexes, ranked, by hashing every cut at once; None when two tokens share a
    hash."""
    count = len(lengths)
    span = _Spans(code)
    whole = lengths > 0
    token_hash = span.hash(starts[whole], starts[whole] + lengths[whole])
    order = np.argsort(token_hash, kind="stable")
    sorted_hash, sorted_token = token_hash[order], np.flatnonzero(whole)[order]
    if np.any(sorted_hash[1:] == sorted_hash[:-1]):
        return None

    # Every cut: the token it splits and the length of its left half.
    cuts = np.maximum(lengths - 1, 0)
    token = np.repeat(np.arange(count), cuts)
    left_length = np.arange(len(token)) - np.repeat(np.cumsum(cuts) - cuts, cuts) + 1
    start, end = starts[token], starts[token] + lengths[token]
    middle = start + left_length
    left = _lookup(span.hash(start, middle), sorted_hash, sorted_token)
    found = left >= 0  # most cuts' left half is no token: their right halves are not looked up
    token, left, left_length, middle, end = token[found], left[found], left_length[found], middle[found], end[found]
    right = _lookup(span.hash(middle, end), sorted_hash, sorted_token)
    found = right >= 0
    found[found] &= (lengths[left[found]] == left_length[found]) & (lengths[right[found]] == (end - middle)[found])
    token, left, right, left_length = token[found], left[found], right[found], left_length[found]
    if int(lengths[token].sum()) > budget:
        raise TooManyMerges()
    same = _equal(code, starts[token], starts[left], left_length) & \
        _equal(code, starts[token] + left_length, starts[right], lengths[token] - left_length)
    token, left, right, left_length = token[same], left[same], right[same], left_length[same]
    ranked = np.lexsort((token, -(lengths[token] - left_length), -left_length, -scores[token]))
    return left[ranked], right[ranked], token[ranked]


class _Spans:
    """Hashes of any [start, end) of the code points: sum of code[j] * BASE^(end - 1 - j), mod 2^64."""

    def __init__(self, code: np.ndarray) -> None:
        n = len(code)
        with np.errstate(over="ignore"):
            self.powers = np.multiply.accumulate(np.full(max(n, 1), _BASE, dtype=np.uint64)) * np.uint64(
                pow(_BASE, -1, 1 << 64))  # BASE^0 .. BASE^(n-1)
            inverse = np.multiply.accumulate(np.full(max(n, 1), pow(_BASE, -1, 1 << 64), dtype=np.uint64)) * \
                np.uint64(_BASE)
            self.prefix = np.zeros(n + 1, dtype=np.uint64)
            np.cumsum(code.astype(np.uint64) * inverse[:n], out=self.prefix[1:])

    def hash(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return (self.prefix[end] - self.prefix[start]) * self.powers[end - 1]


def _lookup(hashes: np.ndarray, sorted_hash: np.ndarray, sorted_token: np.ndarray) -> np.ndarray:
    """The token whose hash each of `hashes` is, or -1."""
    if not len(sorted_hash):
        return np.full(len(hashes), -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(sorted_hash, hashes), len(sorted_hash) - 1)
    return np.where(sorted_hash[at] == hashes, sorted_token[at], -1)


def _equal(code: np.ndarray, a: np.ndarray, b: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Whether code[a[i] : a[i] + length[i]] equals code[b[i] : b[i] + length[i]], for every i."""
    offsets = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    differs = code[np.repeat(a, length) + offsets] != code[np.repeat(b, length) + offsets]
    return np.bincount(np.repeat(np.arange(len(length)), length), weights=differs, minlength=len(length)) == 0


def merges_by_loop(vocab: dict[str, int], priority: dict[str, float]
                   ) -> tuple[list[tuple[str, str]], np.ndarray]:
    """merges_from_vocab one cut at a time: the reference, and the answer when two tokens share a hash."""
    budget = MERGE_CHARS_PER_VOCAB_CHAR * sum(len(token) for token in priority)
    ranked: list[tuple[float, int, int, int, int, int, str, str, int]] = []
    for order, (merged, score) in enumerate(priority.items()):
        merged_id = vocab[merged]
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), order, vocab[left], vocab[right], left, right,
                               merged_id))
                budget -= len(merged)
        if budget < 0:
            raise TooManyMerges()
    ranked.sort()
    ids = np.array([(left, right, merged) for *_, left, right, _l, _r, merged in ranked], dtype=np.int32)
    return [(left, right) for *_, left, right, _ in ranked], ids.reshape(-1, 3)
