"""Speculative decoding: proposals from the job's own text, verified in one step, never change a token.

The C step gives a position the same logits however its tokens were stepped (test_native.py),
and verification keeps a proposal only where the row's own sampler chooses it too, so every
job's tokens, greedy or sampled with a seed, are the tokens decoding one step at a time gives.
These tests compare whole outputs with speculation on and off, and check that speculation
did run (proposals made and kept) where they compare.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from jobs import GREEDY, Job, make_engine, with_tokenizer
from llorch.engine.engine import Engine
from llorch.engine.factory import kv_dtype
from llorch.engine.kv.pool import bytes_per_block
from llorch.engine.request import GenerationRequest, SamplingParams
from llorch.engine.sampler import SamplerState
from llorch.engine.speculative import MAX_PAUSE, NgramSpeculation, RowSpeculation, continuation
from llorch.engine.verify import verify
from llorch.weights.loader import LoadedModel, load_model
from model_zoo import ARCHITECTURES, Q

pytestmark = pytest.mark.cpu

TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
        "members agreed to fund the children's reading room, the archive of local newspapers, and a small garden "
        "behind the building. The mayor thanked everyone for their patience and promised a public meeting in the "
        "spring to present the final plans.")
COPY = f"Text: {TEXT}\n\nThe same text, copied exactly:\n"


def submit(engine: Engine, job_id: str, prompt: str, max_tokens: int, sampling: SamplingParams = GREEDY,
           **fields: Any) -> Job:
    job = Job()
    engine.submit(engine.prepare(GenerationRequest(job_id, prompt, max_tokens, sampling, **fields)), job.emit)
    return job


def outcome(job: Job) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """A finished job's text, its end event without timing, and its log-probability events."""
    end = dict(job.wait())
    end.pop("decode_time_ms", None)
    return job.text, end, [e for e in job.events if e["type"] == "logprob"]


def counters(engine: Engine) -> tuple[float, float]:
    sample = engine.telemetry.registry.get_sample_value
    return (sample("llorch_speculative_proposed_tokens_total") or 0.0,
            sample("llorch_speculative_accepted_tokens_total") or 0.0)


@pytest.fixture(scope="module")
def engines(served: LoadedModel) -> Any:
    """The default model with speculation off and on (the worker's default on this path)."""
    off, on = make_engine(served, speculative="off"), make_engine(served)
    assert on.config.speculative == "ngram" and on.core.scheduler.speculation is not None
    yield off, on
    off.stop()
    on.stop()


# -- proposals ---------------------------------------------------------------------------------------

def test_the_longest_suffix_found_again_proposes_what_followed_its_latest_occurrence() -> None:
    tokens = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7])
    assert continuation(tokens, 3).tolist() == [8, 1, 6]  # 5 6 7 occurs at 0 (6 7 alone, later, is shorter)
    assert continuation(np.array([1, 2, 3, 9, 2, 3, 4, 8, 2, 3]), 2).tolist() == [4, 8]  # the latest 2 3
    assert continuation(np.array([1, 2, 3, 4, 5]), 4).tolist() == []  # nothing repeats
    assert continuation(np.array([3, 3]), 4).tolist() == []  # a suffix has no earlier occurrence with a follower
    assert continuation(np.array([4, 4, 4]), 4).tolist() == [4, 4, 4, 4]  # runs into the end: it repeats
    assert continuation(np.array([7, 1, 2, 3, 1, 2]), 5).tolist() == [3, 1, 2, 3, 1]


def test_a_row_proposes_more_while_kept_and_pauses_after_misses() -> None:
    speculation, state = NgramSpeculation(max_tokens=16, max_rows=4), RowSpeculation()
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17] * 3
    assert speculation.propose(state, ids, 100) == [1, 2, 3, 4]  # the first length
    speculation.verified(state, 4, 4)
    assert len(speculation.propose(state, ids, 100)) == 8
    assert len(speculation.propose(state, ids, 3)) == 3  # the caller's limit
    speculation.verified(state, 8, 2)
    assert len(speculation.propose(state, ids, 100)) == 3  # what was kept, plus one
    for misses in range(1, 8):
        speculation.verified(state, 1, 0)
        pause = min(2**misses - 1, MAX_PAUSE)
        assert [speculation.propose(state, ids, 100) for _ in range(pause)] == [[]] * pause
        assert len(speculation.propose(state, ids, 100)) == 1
    assert (state.proposed, state.accepted) == (4 + 8 + 7, 4 + 2)


# -- verification ------------------------------------------------------------------------------------

def test_a_sampled_row_keeps_a_proposal_with_its_probability_and_otherwise_draws_from_the_rest() -> None:
    """The rejection rule for a proposal of one token: kept with probability p(d); when not, the
    token follows p without d, renormalized. Over many seeds, the first token verification gives
    follows p itself, and so does the second, whatever the proposal."""
    logits = torch.tensor([[1.2, 0.4, 0.0, -0.5, 2.0], [0.3, 1.5, -1.0, 0.8, 0.0]])
    params = SamplingParams(temperature=0.9)
    probs = torch.softmax(logits.double() / 0.9, dim=-1)
    draft = [4]  # the most likely token first: kept often, so the second position is tested too
    first, second, kept = Counter[int](), Counter[int](), 0
    draws = 6000
    for seed in range(draws):
        state = SamplerState(params, seed, [], 5, torch.device("cpu"))
        tokens = [s.token_id for s in verify(logits, draft, state, None)]
        first[tokens[0]] += 1
        if len(tokens) == 2:
            kept += 1
            second[tokens[1]] += 1
    assert abs(kept / draws - float(probs[0, 4])) < 4 * (float(probs[0, 4]) * (1 - float(probs[0, 4])) / draws) ** 0.5
    for counts, p in ((first, probs[0]), (second, probs[1])):
        total = sum(counts.values())
        expected = [float(x) * total for x in p]
        expected[-1] = total - sum(expected[:-1])  # the same total to the last bit, as chisquare requires
        assert chisquare([counts.get(i, 0) for i in range(5)], expected).pvalue > 1e-3


def test_greedy_verification_keeps_the_proposals_the_argmax_agrees_with() -> None:
    logits = torch.full((4, 6), -1.0)
    logits[0, 2] = logits[1, 5] = logits[2, 0] = logits[3, 1] = 3.0
    state = SamplerState(GREEDY, 0, [], 6, torch.device("cpu"))
    assert [s.token_id for s in verify(logits, [2, 5, 0], state, None)] == [2, 5, 0, 1]  # all kept, plus one
    assert [s.token_id for s in verify(logits, [2, 4, 0], state, None)] == [2, 5]  # the first that differs ends
    assert [s.token_id for s in verify(logits, [1, 5, 0], state, None)] == [2]


# -- the engine: the same tokens ----------------------------------------------------------------------

def test_copying_a_text_gives_the_same_tokens_and_most_proposals_are_kept(engines: Any) -> None:
    off, on = engines
    before = counters(on)
    alone = outcome(submit(off, "copy-off", COPY, 96))
    speculated = outcome(submit(on, "copy-on", COPY, 96))
    assert speculated == alone and alone[1]["tokens_out"] == 96
    proposed, kept = (a - b for a, b in zip(counters(on), before, strict=True))
    assert proposed > 0 and kept > 0.5 * proposed  # a copy is where lookup wins


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=3),
    SamplingParams(temperature=0.5, repetition_penalty=1.02, presence_penalty=0.05, seed=11),
    SamplingParams(temperature=0.0, frequency_penalty=0.4, logit_bias=((235248, 2.0),)),
    SamplingParams(temperature=0.9, min_tokens=40, seed=5),
], ids=["temperature", "top-k-p", "penalties", "greedy-penalized", "min-tokens"])
def test_a_sampled_or_penalized_job_gives_the_same_tokens_with_its_seed(engines: Any,
                                                                         sampling: SamplingParams) -> None:
    off, on = engines
    before = counters(on)
    alone = outcome(submit(off, "s-off", COPY, 64, sampling))
    assert outcome(submit(on, "s-on", COPY, 64, sampling)) == alone
    assert counters(on)[0] > before[0]


def test_log_probabilities_and_stop_strings_are_those_of_decoding_token_by_token(engines: Any) -> None:
    off, on = engines
    for fields in ({"logprobs": 3}, {"stop": ("reading room",)}, {"stop": ("garden",), "logprobs": 0}):
        alone = outcome(submit(off, "l-off", COPY, 80, **fields))
        speculated = outcome(submit(on, "l-on", COPY, 80, **fields))
        assert speculated == alone, fields
    assert alone[1]["stop_reason"] == "STOP_SEQUENCE" and "garden" not in alone[0]


def test_max_tokens_ends_exactly_and_the_pool_is_whole_afterwards(engines: Any) -> None:
    _, on = engines
    for max_tokens in (1, 2, 5, 17):
        assert outcome(submit(on, f"m{max_tokens}", COPY, max_tokens))[1]["tokens_out"] == max_tokens
    assert on.core.scheduler.blocks.used_blocks == 0


def test_cached_blocks_hold_only_kept_tokens(served: LoadedModel) -> None:
    """A job that reads another's prompt and output reuses its cached blocks, and gets the tokens a fresh
    engine gives: blocks filled while proposals were rejected were registered with kept tokens only."""
    on = make_engine(served)
    try:
        first = submit(on, "first", COPY, 120)
        first.wait()
        prompt = COPY + first.text
        assert on.telemetry.registry.get_sample_value("llorch_speculative_accepted_tokens_total")
        follow = outcome(submit(on, "follow", prompt, 40))
        assert on.telemetry.registry.get_sample_value("llorch_prefix_cache_hit_tokens_total") >= 64
    finally:
        on.stop()
    fresh = make_engine(served, speculative="off", prefix_caching=False)
    try:
        assert outcome(submit(fresh, "fresh", prompt, 40)) == follow
    finally:
        fresh.stop()


def test_jobs_batched_and_preempted_keep_their_tokens(served: LoadedModel) -> None:
    """Several jobs at once in a pool too small for all (preemption), with speculation: each gets its
    tokens alone without it."""
    prompts = [COPY, "1, 2, 3, 4, 5, 6, 7, 8,", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", TEXT]
    alone = make_engine(served, speculative="off")
    try:
        expected = [outcome(submit(alone, f"a{i}", p, 48)) for i, p in enumerate(prompts)]
    finally:
        alone.stop()
    engine = make_engine(served, kv_cache_bytes=14 * bytes_per_block(served.config, kv_dtype(served)), max_running=4)
    try:
        jobs = [submit(engine, f"b{i}", p, 48) for i, p in enumerate(prompts)]
        assert [outcome(job) for job in jobs] == expected
        assert counters(engine)[1] > 0
        assert engine.telemetry.registry.get_sample_value("llorch_preemptions_total")
    finally:
        engine.stop()


def test_the_job_log_line_gives_its_proposals(engines: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, on = engines
    with caplog.at_level(logging.INFO, logger="llorch.engine"):
        submit(on, "logged", COPY, 40).wait()
        deadline = time.monotonic() + 10  # the line follows the end event, on the engine's thread
        while time.monotonic() < deadline:
            finished = [r for r in caplog.records if r.getMessage() == "job finished" and r.job_id == "logged"]
            if finished:
                break
            time.sleep(0.01)
    assert finished and 0 < finished[0].accepted_proposals <= finished[0].proposed_tokens


class Oracle(NgramSpeculation):
    """Proposes a known continuation with every fifth proposal wrong: each step keeps some and rejects one."""

    def __init__(self, prompt_ids: list[int], continuation: list[int]) -> None:
        super().__init__(max_tokens=7, max_rows=4)
        self.prompt, self.continuation = len(prompt_ids), continuation

    def propose(self, state: RowSpeculation, token_ids: list[int], limit: int) -> list[int]:
        done = len(token_ids) - self.prompt
        draft = self.continuation[done : done + min(limit, 7)]
        return [t if (done + i) % 5 else t + 1 for i, t in enumerate(draft)]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q6_K, Q.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_and_block_type_decodes_the_same_tokens(zoo: dict[str, Path], arch: str,
                                                                   qtype: Q) -> None:
    """Random weights repeat nothing, so proposals come from the known output, some of them wrong: the
    tokens verification keeps are still those of decoding one token at a time."""
    from conftest import exported

    loaded = load_model(exported(zoo, arch, qtype), torch.device("cpu"), torch.float32, keep_quantized=True)
    loaded = with_tokenizer(loaded, eos_token_ids=frozenset())  # random weights: run to max_tokens
    prompt = "one two three four five six seven eight nine ten"
    engine = make_engine(loaded, speculative="off", ctx_size=256, kv_cache_bytes=None)
    try:
        alone = submit(engine, "z", prompt, 60, logprobs=2)
        expected = outcome(alone)
        prompt_ids = list(engine.prepare(GenerationRequest("p", prompt, 60)).prompt_ids)
        engine.core.scheduler.speculation = Oracle(prompt_ids, [
            e["token_id"] for e in alone.events if e["type"] == "logprob"])
        assert outcome(submit(engine, "z", prompt, 60, logprobs=2)) == expected
        proposed, kept = counters(engine)
        assert expected[1]["tokens_out"] == 60 and 0 < kept < proposed
    finally:
        engine.stop()


def test_the_flags_choose_the_mode_and_a_path_without_batch_invariance_defaults_off(ours: LoadedModel) -> None:
    from llorch.engine.config import EngineConfig
    from llorch.workers import build_parser

    parser = build_parser("llorch-cpu-worker", "cpu")
    config = EngineConfig.from_args(parser.parse_args(["--speculative", "off", "--speculative-tokens", "5"]))
    assert (config.speculative, config.speculative_tokens) == ("off", 5)
    assert EngineConfig.from_args(parser.parse_args([])).speculative is None  # the factory decides
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative", "eagle"])
    dense = make_engine(ours, start=False)  # float32 weights run by torch: not batch-invariant
    assert dense.config.speculative == "off" and dense.core.scheduler.speculation is None


def test_a_constrained_job_speculates_within_its_grammar_and_keeps_its_tokens(engines: Any) -> None:
    """Proposals the grammar forbids are cut before the step; each proposal row is masked by the
    grammar after the proposals before it; the JSON is the one decoding token by token gives."""
    import json

    from llorch.engine.request import Constraint

    off, on = engines
    schema = {"type": "array", "minItems": 4, "items": {"type": "object", "required": ["name", "city", "age"],
              "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
              "additionalProperties": False}}
    constraint = Constraint("json_schema", json.dumps(schema), "json_schema")
    prompt = 'People as JSON: [{"name": "Ann", "city": "Oslo", "age": 31}, {"name": "Bo", "city": "Rome", "age": 7}]\n'
    before = counters(on)
    alone = outcome(submit(off, "j-off", prompt, 120, constraint=constraint))
    speculated = outcome(submit(on, "j-on", prompt, 120, constraint=constraint))
    assert speculated == alone
    assert counters(on)[1] > before[1]  # proposals were kept
    assert len(json.loads(alone[0])) >= 4


# -- a draft model -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zoo_target(zoo: dict[str, Path]) -> tuple[Path, LoadedModel]:
    from conftest import exported

    path = exported(zoo, "llama", Q.Q8_0)
    loaded = load_model(path, torch.device("cpu"), torch.float32, keep_quantized=True)
    return path, with_tokenizer(loaded, eos_token_ids=frozenset())  # random weights: run to max_tokens


def decode(engine: Engine, prompts: list[str], sampling: SamplingParams = GREEDY) -> list[Any]:
    jobs = [submit(engine, f"d{i}", prompt, 48, sampling, logprobs=1) for i, prompt in enumerate(prompts)]
    return [outcome(job) for job in jobs]


DRAFT_PROMPTS = ["one two three four", "ten nine eight seven six"]


def test_the_model_itself_as_its_draft_has_every_greedy_proposal_kept(zoo_target: tuple[Path, LoadedModel]) -> None:
    """The same model guesses what the target computes, bit for bit: a proposal that is not kept would
    mean the draft's cache lost track of the row's tokens."""
    path, loaded = zoo_target
    off = make_engine(loaded, speculative="off", kv_cache_bytes=None, ctx_size=256)
    try:
        expected = decode(off, DRAFT_PROMPTS)
    finally:
        off.stop()
    engine = make_engine(loaded, draft_model=str(path), kv_cache_bytes=None, ctx_size=256)
    try:
        assert engine.config.speculative == "draft"  # the default with a draft model
        assert decode(engine, DRAFT_PROMPTS) == expected
        proposed, kept = counters(engine)
        assert proposed > 20 and kept == proposed
        assert engine.core.scheduler.speculation.blocks.used_blocks == 0  # type: ignore[union-attr]
    finally:
        engine.stop()


@pytest.mark.parametrize("draft_arch", ["qwen2", "mistral"])
def test_another_model_as_draft_changes_no_token_greedy_or_sampled(zoo: dict[str, Path], draft_arch: str,
                                                                   zoo_target: tuple[Path, LoadedModel]) -> None:
    from conftest import exported

    _, loaded = zoo_target
    sampled = SamplingParams(temperature=0.8, seed=5)
    off = make_engine(loaded, speculative="off", kv_cache_bytes=None, ctx_size=256)
    try:
        expected = decode(off, DRAFT_PROMPTS), decode(off, DRAFT_PROMPTS, sampled)
    finally:
        off.stop()
    engine = make_engine(loaded, draft_model=str(exported(zoo, draft_arch, Q.Q8_0)), kv_cache_bytes=None,
                         ctx_size=256)
    try:
        assert (decode(engine, DRAFT_PROMPTS), decode(engine, DRAFT_PROMPTS, sampled)) == expected
        assert counters(engine)[0] > 0
        scheduler = engine.core.scheduler
        assert scheduler.blocks.used_blocks == 0 and scheduler.speculation.blocks.used_blocks == 0  # type: ignore[union-attr]
    finally:
        engine.stop()


def test_a_draft_model_of_another_vocabulary_or_contradicting_flags_fail_in_one_line(
        zoo_target: tuple[Path, LoadedModel], model_path: Path) -> None:
    from llorch.engine.config import EngineConfig
    from llorch.engine.factory import build_engine
    from llorch.errors import StartupError

    path, loaded = zoo_target
    with pytest.raises(StartupError, match="vocabulary"):
        build_engine(EngineConfig(draft_model=str(model_path), ctx_size=256), loaded=loaded)
    with pytest.raises(StartupError, match="--speculative draft needs --draft-model"):
        build_engine(EngineConfig(speculative="draft"), loaded=loaded)
    with pytest.raises(StartupError, match="--draft-model is used by --speculative draft only"):
        build_engine(EngineConfig(speculative="ngram", draft_model=str(path)), loaded=loaded)
