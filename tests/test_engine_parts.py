"""The engine's text pipeline and sampler, tested on their own."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llorch.engine.detokenizer import IncrementalDetokenizer
from llorch.engine.request import SamplingParams
from llorch.engine.sampler import make_generator, sample
from llorch.engine.stop import StopMatcher
from llorch.weights.loader import LoadedModel

pytestmark = pytest.mark.cpu

texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_streamed_pieces_reassemble_exactly_and_stay_valid_utf8(ours: LoadedModel, text: str) -> None:
    ids = ours.tokenizer.backend.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(ours.tokenizer.decode, ours.tokenizer.byte_token_ids, ours.tokenizer.special_ids)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == ours.tokenizer.decode(ids)
    for piece in pieces[:-1]:
        assert not piece.endswith("\ufffd")
        piece.encode("utf-8")  # no lone surrogates


def test_a_character_split_across_byte_tokens_is_held_back(ours: LoadedModel) -> None:
    # Byte-fallback tokens for the three UTF-8 bytes of "€" (E2 82 AC).
    byte_ids = [ours.tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    detok = IncrementalDetokenizer(ours.tokenizer.decode, ours.tokenizer.byte_token_ids, ours.tokenizer.special_ids)
    assert [detok.add(i) for i in byte_ids] == ["", "", ""]
    assert detok.add(ours.tokenizer.backend.token_to_id("▁the")) == "€ the"


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc \n", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8),
       stops=st.lists(st.text(alphabet="abc \n", min_size=1, max_size=4), min_size=1, max_size=4))
def test_stop_text_is_never_emitted(text: str, cuts: list[int], stops: list[str]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    matcher = StopMatcher(tuple(stops))
    out = "".join(matcher.feed(text[a:b]) for a, b in pairwise(bounds)) + matcher.flush()
    assert text.startswith(out)
    if matcher.matched is None:
        assert out == text
        assert not any(s in text for s in stops)
    else:
        assert text[len(out):].startswith(matcher.matched)
    assert not any(s in out for s in stops)


def test_greedy_is_argmax_whatever_the_seed() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    params = SamplingParams(temperature=0.0)
    assert int(sample(logits, params, torch.empty(0, dtype=torch.long), None)) == 1


def test_same_seed_same_draws_and_top_k_stays_in_the_top_k() -> None:
    logits = torch.linspace(0, 1, 50)
    params = SamplingParams(temperature=2.0, top_k=3, seed=99)
    none = torch.empty(0, dtype=torch.long)
    generator = make_generator(99, torch.device("cpu"))
    first = [int(sample(logits, params, none, generator)) for _ in range(300)]
    generator = make_generator(99, torch.device("cpu"))
    second = [int(sample(logits, params, none, generator)) for _ in range(300)]
    assert first == second
    assert set(first) <= {47, 48, 49}
    assert len(set(first)) == 3


def test_repetition_penalty_lowers_seen_tokens() -> None:
    logits = torch.tensor([2.0, 1.9, -1.0])
    seen = torch.tensor([0])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert int(sample(logits, params, seen, None)) == 1


def test_full_uint64_seed_range_is_accepted() -> None:
    for seed in (0, 2**63 - 1, 2**63, 2**64 - 1):
        make_generator(seed, torch.device("cpu"))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_token_streams_never_emit_broken_utf8(ours: LoadedModel, data: st.DataObject) -> None:
    """Any id sequence, including byte-fallback tokens that split characters, streams safely."""
    backend = ours.tokenizer.backend
    byte_ids = [backend.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    some_words = [backend.token_to_id(w) for w in ("▁the", "▁café", "中", "▁", "\n") if backend.token_to_id(w)]
    ids = data.draw(st.lists(st.sampled_from(byte_ids + some_words) | st.integers(300, 262_000), max_size=30))
    detok = IncrementalDetokenizer(ours.tokenizer.decode, ours.tokenizer.byte_token_ids, ours.tokenizer.special_ids)
    pieces = [detok.add(i) for i in ids]
    final = detok.flush()
    assert "".join(pieces) + final == ours.tokenizer.decode(ids)
    for piece in pieces:
        assert not piece.endswith("\ufffd")
