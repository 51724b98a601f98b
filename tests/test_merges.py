"""Merges recovered from a SentencePiece vocabulary: the vectorized search and the C one give exactly the loop's
merges.

The loop (merges_by_loop) is the rule written out: every cut of every token whose halves are
tokens, ranked by the merged token's priority, then the longer left part, the longer right
part and vocabulary order. The tokenizer tests hold its result to SentencePiece and to the
reference tokenizer; here the fast path is held to it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from llorch.kernels import build
from llorch.weights import merges
from llorch.weights.gguf import GGUFFile
from llorch.weights.merges import TooManyMerges, merges_by_loop, merges_from_vocab

pytestmark = pytest.mark.cpu

SPACE_MARK = "\u2581"


@pytest.fixture(scope="module")
def kernels() -> ctypes.CDLL:
    try:
        return build.library()
    except build.KernelUnavailable as exc:
        pytest.skip(f"the C kernels are not available here: {exc}")


def same_as_loop(vocab: dict[str, int], priority: dict[str, float], lib: ctypes.CDLL | None = None
                 ) -> list[tuple[str, str]]:
    """numpy's search (and the C one, given the kernels) against the loop."""
    slow, slow_ids = merges_by_loop(vocab, priority)
    for kernels in (None, lib) if lib is not None else (None,):
        fast, fast_ids = merges_from_vocab(vocab, priority, kernels)
        assert fast == slow
        assert fast_ids.dtype == slow_ids.dtype and fast_ids.shape == slow_ids.shape
        assert np.array_equal(fast_ids, slow_ids)
    return slow


def test_the_default_models_vocabulary(model_path: Path, kernels: ctypes.CDLL) -> None:
    """Gemma 3's 262k tokens, ranked by vocabulary position as the converter reads that file."""
    tokens = list(GGUFFile(model_path).metadata["tokenizer.ggml.tokens"])
    tokens = [SPACE_MARK * len(t) if " " in t and not t.strip() else t for t in tokens]
    found = same_as_loop({t: i for i, t in enumerate(tokens)}, {t: -i for i, t in enumerate(tokens)}, kernels)
    assert len(found) > len(tokens)  # about two merges a token


def test_ties_duplicates_and_characters_beyond_the_basic_plane(kernels: ctypes.CDLL) -> None:
    """Equal scores fall back to the lengths and then vocabulary order; a token listed twice keeps its
    first place in that order and its last id (as the dicts built from the file do)."""
    tokens = ["<unk>", "a", "b", "ab", "ba", "aba", "bab", "abab", "🎉", "a🎉", "🎉b", "a🎉b", "ab", "", "x"]
    scores = [0.0, -1.0, -1.0, -2.0, -2.0, -3.0, -3.0, -3.0, -1.0, -2.0, -2.0, -2.0, -5.0, 0.0, float("-inf")]
    vocab = {t: i for i, t in enumerate(tokens)}
    priority = {t: s for t, s in zip(tokens, scores, strict=True)}
    found = same_as_loop(vocab, priority, kernels)
    assert ("a", "🎉") in found and ("ab", "ab") in found and ("a", "bab") in found


def test_tokens_that_share_a_hash_are_left_to_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a base of 1 the hash is the sum of the characters: "ab" and "ba" collide."""
    monkeypatch.setattr(merges, "_BASE", 1)
    tokens = ["a", "b", "ab", "ba", "aab", "aba"]
    found = same_as_loop({t: i for i, t in enumerate(tokens)}, {t: -i for i, t in enumerate(tokens)})
    assert ("a", "ba") in found and ("ab", "a") in found


def test_a_vocabulary_that_splits_every_way_is_refused(kernels: ctypes.CDLL) -> None:
    tokens = ["b" * n for n in range(1, 301)]
    vocab = {t: i for i, t in enumerate(tokens)}
    priority = {t: 0.0 for t in tokens}
    for lib in (None, kernels):
        with pytest.raises(TooManyMerges, match="more merges than 8x"):
            merges_from_vocab(vocab, priority, lib)
    with pytest.raises(TooManyMerges, match="more merges than 8x"):
        merges_by_loop(vocab, priority)
