"""The engine's text pipeline and sampler, tested on their own."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llorch.engine.detokenizer import WINDOW_TOKENS, IncrementalDetokenizer
from llorch.engine.penalties import penalized
from llorch.engine.request import SamplingParams
from llorch.engine.sampler import SamplerState, filtered_probs, sample_batch
from llorch.engine.stop import StopMatcher
from llorch.weights.loader import LoadedModel
from llorch.weights.tokenizer import Tokenizer, tokenizer_from_gguf
from model_zoo import train_tokenizer
from tiny_model import tiny_vocab

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


CPU = torch.device("cpu")


def state(params: SamplingParams, seed: int = 0, prompt: tuple[int, ...] = (), vocab: int = 50) -> SamplerState:
    return SamplerState(params, seed, list(prompt), vocab, CPU)


def test_greedy_is_argmax_whatever_the_seed() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    params = SamplingParams(temperature=0.0)
    assert [sample_batch(logits, [state(params, seed)])[0].token_id for seed in (0, 1, 2**64 - 1)] == [1, 1, 1]


def test_same_seed_same_draws_and_top_k_stays_in_the_top_k() -> None:
    logits = torch.linspace(0, 1, 50)[None]
    params = SamplingParams(temperature=2.0, top_k=3, seed=99)
    first, second = state(params, 99), state(params, 99)
    draws = [(sample_batch(logits, [first])[0].token_id, sample_batch(logits, [second])[0].token_id)
             for _ in range(300)]
    assert all(a == b for a, b in draws)
    assert {a for a, _ in draws} == {47, 48, 49}


def test_a_row_draws_the_same_tokens_alone_or_in_any_batch() -> None:
    """Same seed, same tokens at any concurrency: the batch around a row changes nothing."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=generator) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8),
              SamplingParams(temperature=1.3, top_k=40, min_p=0.02), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, repetition_penalty=1.3), SamplingParams(temperature=0.5, top_k=1)]
    prompts = [(1, 2), (3,), (), (4, 4), (10, 11, 12), ()]

    def states() -> list[SamplerState]:
        return [state(p, seed=100 + i, prompt=prompts[i], vocab=1000) for i, p in enumerate(params)]

    alone = [[sample_batch(logits[i : i + 1], [s], [3])[0] for _ in range(20)] for i, s in enumerate(states())]
    together_states = states()
    together = [sample_batch(logits, together_states, [3] * 6) for _ in range(20)]
    for i in range(6):
        assert [step[i] for step in together] == alone[i]


def test_repetition_penalty_lowers_seen_tokens() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert sample_batch(logits, [state(params, prompt=(0,), vocab=3)])[0].token_id == 1


def test_requested_logprobs_are_the_log_softmax_of_the_raw_logits() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]])
    sampled = sample_batch(logits, [state(SamplingParams(temperature=0.0), vocab=4)], [2])[0]
    expected = torch.log_softmax(logits[0], -1)
    assert sampled.token_id == 1
    assert sampled.logprob == pytest.approx(float(expected[1]))
    assert [t for t, _ in sampled.top] == [1, 3]
    assert [v for _, v in sampled.top] == pytest.approx([float(expected[1]), float(expected[3])])


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-45),
                                    SamplingParams(temperature=0.7, repetition_penalty=0.0),
                                    SamplingParams(temperature=1e-300, repetition_penalty=0.0, top_p=0.5)])
def test_extreme_accepted_values_still_sample(params: SamplingParams) -> None:
    """The smallest temperatures are greedy in effect, and a zero penalty is a strong one: never NaN."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [0.0, 0.0, 3.0, 0.0]])
    states = [state(params, 7, prompt=(1,), vocab=4) for _ in range(2)]
    tokens = [s.token_id for s in sample_batch(logits, states)]
    if params.repetition_penalty == 1.0:
        assert tokens == [1, 2]
    else:  # a penalty below 1 favours what was seen; at 0 the seen token with a positive logit wins
        assert tokens[0] == 1
    for row, s in zip(logits, states, strict=True):
        probs = filtered_probs(penalized(row, s), params)
        assert torch.isfinite(probs).all() and float(probs.sum()) == pytest.approx(1.0)


def test_full_uint64_seed_range_is_accepted() -> None:
    logits = torch.zeros(1, 5)
    for seed in (0, 2**63 - 1, 2**63, 2**64 - 1):
        assert 0 <= sample_batch(logits, [state(SamplingParams(), seed, vocab=5)])[0].token_id < 5


def spm_with_dummy_prefix(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A SentencePiece-style vocabulary whose decoder strips the leading space (Llama 2, Mistral)."""
    tokens, scores, types = tiny_vocab()
    words = ["▁café", "中", "▁▁", "é"]
    metadata = {"general.architecture": "llama", "tokenizer.ggml.model": "llama",
                "tokenizer.ggml.tokens": tokens + words,
                "tokenizer.ggml.scores": np.array(scores + [-20.0] * len(words), dtype=np.float32),
                "tokenizer.ggml.token_type": types + [1] * len(words), "tokenizer.ggml.bos_token_id": 2,
                "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
                "tokenizer.ggml.add_space_prefix": True}
    return tokenizer_from_gguf(metadata, tmp_path_factory.mktemp("spm") / "vocab.gguf")


@pytest.fixture(scope="module")
def decoder_kinds(ours: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    """One tokenizer of each decoder kind the worker builds."""
    byte_level = train_tokenizer()
    return {
        "sentencepiece-gemma": ours.tokenizer,  # byte fallback, spaces kept
        "sentencepiece-dummy-prefix": spm_with_dummy_prefix(tmp_path_factory),  # byte fallback, leading space stripped
        "byte-level-bpe": Tokenizer.around(byte_level, byte_level.token_to_id("<|begin_of_text|>"),
                                           {byte_level.token_to_id("<|end_of_text|>")}),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), kind=st.sampled_from(["sentencepiece-gemma", "sentencepiece-dummy-prefix", "byte-level-bpe"]))
def test_streamed_pieces_equal_full_decoding_for_every_decoder_kind(
    decoder_kinds: dict[str, Tokenizer], data: st.DataObject, kind: str
) -> None:
    """Random id streams (byte tokens splitting characters, specials, spaces, words) stream exactly."""
    tokenizer = decoder_kinds[kind]
    size = tokenizer.backend.get_vocab_size()
    frequent = [i for i in (tokenizer.backend.token_to_id(t) for t in ("▁", "▁▁", "▁the", "é", "Ġ", "Ġthe"))
                if i is not None]
    specials = sorted(tokenizer.special_ids)
    pool = st.integers(0, size - 1) | st.sampled_from(frequent + specials)
    if tokenizer.byte_token_ids:
        pool = pool | st.sampled_from(sorted(tokenizer.byte_token_ids))
    ids = data.draw(st.lists(pool, max_size=40))
    detok = IncrementalDetokenizer(tokenizer.decode, tokenizer.byte_token_ids, tokenizer.special_ids)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids)
    for piece in pieces:
        assert not piece.endswith("\ufffd")


def test_per_token_work_stays_bounded_however_long_the_output(ours: LoadedModel) -> None:
    """The detokenizer decodes a short window about once per token, not the whole output again (O(1), not O(n))."""
    decoded_lengths: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        decoded_lengths.append(len(ids))
        return ours.tokenizer.decode(ids)

    ids = ours.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 200, add_special_tokens=False)
    detok = IncrementalDetokenizer(decode, ours.tokenizer.byte_token_ids, ours.tokenizer.special_ids)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert len(ids) > 2000
    assert text == ours.tokenizer.decode(ids)
    assert max(decoded_lengths) <= WINDOW_TOKENS + 4
    assert len(decoded_lengths) <= 1.25 * len(ids)


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


@pytest.mark.parametrize("host", [False, True], ids=["torch", "numpy"])
def test_min_tokens_keeps_the_end_tokens_out_until_that_many_are_drawn(host: bool) -> None:
    eos = (3, 7)
    state = SamplerState(SamplingParams(temperature=0.0, min_tokens=2), 0, [1, 2], 16,
                         None if host else torch.device("cpu"), eos)
    logits = torch.zeros(16)
    logits[3] = 10.0  # the end token is by far the likeliest
    logits[9] = 5.0  # then this one
    rows = logits[None].numpy() if host else logits[None]
    drawn = []
    for _ in range(3):
        drawn.append(sample_batch(rows, [state])[0].token_id)
        state.accept(drawn[-1])
    assert drawn == [9, 9, 3]
    rows[0, 11] = 20.0  # an argmax that is no end token stands while they are held back
    blocked = SamplerState(SamplingParams(temperature=0.0, min_tokens=2), 0, [1, 2], 16,
                           None if host else torch.device("cpu"), eos)
    assert sample_batch(rows, [blocked])[0].token_id == 11


def test_an_engine_loop_that_dies_ends_every_job_and_refuses_new_ones(ours: LoadedModel) -> None:
    from jobs import make_engine, run
    from llorch.engine.errors import QueueFull

    engine = make_engine(ours, start=False)

    def broken() -> None:
        raise RuntimeError("a scheduling bug")

    engine.core.scheduler.schedule = broken  # type: ignore[method-assign]
    doomed = run(engine, "doomed")
    engine.start()
    try:
        ending = doomed.wait(30)
        assert ending["type"] == "error" and ending["code"] == "INFERENCE_FAILED" and "scheduling bug" in \
            ending["message"]
        assert len(doomed.terminal_events) == 1
        with pytest.raises(QueueFull, match="stopped"):
            run(engine, "late")
    finally:
        engine.stop()
