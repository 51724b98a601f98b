"""The scheduler alone, without a model: made-up step outputs drive it, as the engine core's results would.

Each test plays steps: schedule, mark the chunks computed (what the runner's forward
does to the KV cache), and hand the sampling rows tokens chosen by the test. What is
checked is what a user relies on: prompts are read in bounded chunks while others keep
decoding, the oldest job always progresses, a preempted job resumes where it was,
cached prefixes are reused, prompt scoring gets every row once, and a row may accept
several tokens (or none) in one step with every end honoured exactly where it falls.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llorch.engine.kv.blocks import BlockAllocator
from llorch.engine.plan import StepPlan
from llorch.engine.request import GenerationRequest, PreparedJob, StopReason
from llorch.engine.scheduler import SCORED_ROWS_PER_STEP, GrammarRefused, Scheduler
from llorch.engine.sequence import Sequence, SequenceState

BLOCK = 4
EOS = 2


def make_seq(job_id: str, prompt: list[int], max_tokens: int = 8, arrival: int = 0,
             prompt_logprobs: int | None = None) -> Sequence:
    request = GenerationRequest(job_id, None, max_tokens, prompt_ids=tuple(prompt), prompt_logprobs=prompt_logprobs)
    return Sequence(PreparedJob(request, tuple(prompt), max_tokens), seed=0, arrival=arrival, block_size=BLOCK)


def scheduler(blocks: int = 64, max_running: int = 4, max_batch_tokens: int = 8) -> Scheduler:
    return Scheduler(BlockAllocator(blocks, BLOCK), max_running, max_batch_tokens, eos_token_ids=[EOS])


def play(sched: Scheduler, tokens: Callable[[Sequence], list[int]] = lambda seq: [7]) -> StepPlan:
    """One step: the forward computes every chunk, and each row that completes accepts `tokens(seq)`."""
    plan = sched.schedule()
    sampling = [c.seq for c in plan.chunks if c.completes and c.seq.max_tokens > 0]
    for chunk in plan.chunks:
        sched.computed(chunk)
    for seq in sampling:
        if seq.state is SequenceState.RUNNING:
            sched.accept(seq, tokens(seq))
    return plan


def test_a_long_prompt_is_read_in_chunks_while_a_decoding_job_gets_a_token_every_step() -> None:
    sched = scheduler(max_batch_tokens=8)
    short = make_seq("short", [5, 6, 7], arrival=1)
    sched.add(short)
    play(sched)  # reads the short prompt and samples its first token
    assert short.output_ids == [7]
    long = make_seq("long", list(range(10, 30)), arrival=2)
    sched.add(long)
    fed = []
    for _ in range(3):
        plan = play(sched)
        assert plan.chunks[0].seq is short and plan.chunks[0].tokens == 1  # single tokens come first
        fed.append(next(c.tokens for c in plan.chunks if c.seq is long))
    assert fed == [8, 8, 4]  # the budget bounds each step's prompt tokens
    assert len(long.output_ids) == 1  # sampled only once the whole prompt is in the cache
    assert len(short.output_ids) == 4


def test_jobs_are_admitted_in_arrival_order_up_to_max_running_and_leave_at_max_tokens() -> None:
    sched = scheduler(max_running=2)
    seqs = [make_seq(f"j{i}", [5, 6], max_tokens=2, arrival=i) for i in range(3)]
    for seq in reversed(seqs):  # added out of order: arrival decides
        sched.add(seq)
    plan = play(sched)
    assert plan.admitted == seqs[:2] and sched.waiting[0] is seqs[2]
    play(sched)  # the second token reaches max_tokens: both end and free their slots
    assert all(s.state is SequenceState.FINISHED for s in seqs[:2])
    assert all(not s.blocks.blocks for s in seqs[:2])
    plan = play(sched)
    assert plan.admitted == [seqs[2]]


def test_the_newest_job_is_preempted_when_blocks_run_out_and_resumes_with_its_tokens() -> None:
    sched = scheduler(blocks=5, max_batch_tokens=16)  # 4 usable blocks of 4 tokens
    old = make_seq("old", [5, 6, 7], max_tokens=20, arrival=1)
    new = make_seq("new", [8, 9, 10], max_tokens=20, arrival=2)
    sched.add(old)
    sched.add(new)
    preempted = None
    for _ in range(12):
        plan = play(sched)
        if plan.preempted:
            preempted = plan
            break
    assert preempted is not None and preempted.preempted == [new]
    assert new.state is SequenceState.WAITING and not new.blocks.blocks and new.blocks.computed == 0
    assert old.state is SequenceState.RUNNING  # the oldest job always makes progress
    produced = list(new.output_ids)
    sched.finish(old)  # frees the pool: the preempted job comes back
    plan = play(sched)
    assert plan.resumed == [new] and plan.admitted == []
    # It recomputes prompt and output so far, then goes on from where it was.
    assert new.output_ids[: len(produced)] == produced and len(new.output_ids) == len(produced) + 1
    assert new.blocks.computed == len(new.token_ids) - 1


def test_a_cached_prefix_is_reused_by_a_later_job_with_the_same_prompt_start() -> None:
    sched = scheduler()
    prompt = list(range(10, 20))  # two full blocks and two tokens
    first = make_seq("first", prompt, max_tokens=1, arrival=1)
    sched.add(first)
    play(sched)
    play(sched)  # the budget of 8 reads the prompt in two steps
    assert first.state is SequenceState.FINISHED
    second = make_seq("second", [*prompt[:8], 99, 98, 97], arrival=2)
    sched.add(second)
    plan = play(sched)
    assert plan.prefix_hit_tokens == 8  # both full blocks of the shared start
    assert next(c.tokens for c in plan.chunks if c.seq is second) == 3  # only the new tokens are read


def test_prompt_scoring_gets_every_row_once_in_capped_steps_and_never_from_the_cache() -> None:
    sched = scheduler(max_batch_tokens=4 * SCORED_ROWS_PER_STEP)
    prompt = list(range(10, 10 + 2 * SCORED_ROWS_PER_STEP + 5))
    warm = make_seq("warm", prompt, max_tokens=1, arrival=1)  # caches the prompt's blocks
    sched.add(warm)
    play(sched)
    assert warm.state is SequenceState.FINISHED
    scorer = make_seq("scorer", prompt, max_tokens=1, arrival=2, prompt_logprobs=0)
    sched.add(scorer)
    rows: list[int] = []
    while scorer.state is not SequenceState.FINISHED:
        plan = sched.schedule()
        assert plan.prefix_hit_tokens == 0  # cached blocks hold no logits
        for chunk in plan.chunks:
            start = chunk.seq.blocks.computed
            scored = chunk.seq.scored_rows(start, chunk.tokens)
            assert len(scored) <= SCORED_ROWS_PER_STEP
            rows.extend(scored)
            completes = chunk.completes
            sched.computed(chunk)
            if scored:
                sched.scored(chunk.seq, scored.stop + 1)
            if completes:
                sched.accept(chunk.seq, [7])
    assert rows == list(range(len(prompt) - 1))  # row r scores token r + 1: every token but the first, once


def test_a_row_accepts_several_tokens_in_one_step_and_the_next_step_reads_them() -> None:
    sched = scheduler()
    seq = make_seq("spec", [5, 6, 7], max_tokens=10)
    sched.add(seq)
    play(sched, lambda s: [11, 12, 13])
    assert seq.output_ids == [11, 12, 13]
    plan = play(sched, lambda s: [])  # a step may accept nothing: the job goes on
    chunk = next(c for c in plan.chunks if c.seq is seq)
    assert chunk.tokens == 3 and seq.state is SequenceState.RUNNING  # its new tokens go into the cache


@pytest.mark.parametrize(("tokens", "kept", "reason"), [
    ([11, EOS, 12], [11], StopReason.EOS),  # the end token is never appended; what follows it is dropped
    ([11, 12, 13, 14], [11, 12, 13], StopReason.MAX_TOKENS),  # ends at max_tokens, mid-list
    ([11], [11], None),
])
def test_an_end_inside_a_row_s_tokens_ends_the_job_exactly_there(tokens: list[int], kept: list[int],
                                                                   reason: StopReason | None) -> None:
    sched = scheduler()
    seq = make_seq("ends", [5, 6, 7], max_tokens=3)
    sched.add(seq)
    sched.schedule()
    free_before = sched.blocks.free_blocks
    accepted = sched.accept(seq, tokens)
    assert accepted.tokens == kept and accepted.reason is reason and seq.output_ids == kept
    if reason is not None:
        assert seq.state is SequenceState.FINISHED and sched.idle
        assert sched.blocks.free_blocks > free_before  # its blocks went back to the pool


class FakeMatcher:
    """A grammar that accepts token ids up to `limit` and is complete after `length` of them."""

    def __init__(self, length: int, limit: int = 100) -> None:
        self.consumed: list[int] = []
        self.length = length
        self.limit = limit

    def consume_token(self, token_id: int) -> bool:
        if token_id > self.limit:
            return False
        self.consumed.append(token_id)
        return True

    def is_stopped(self) -> bool:
        return len(self.consumed) >= self.length


def test_the_grammar_s_end_ends_the_job_and_a_refused_token_is_raised() -> None:
    sched = scheduler()
    seq = make_seq("json", [5, 6, 7], max_tokens=10)
    sched.add(seq)
    sched.schedule()
    seq.matcher = FakeMatcher(length=2)  # type: ignore[assignment]
    accepted = sched.accept(seq, [11, 12, 13])
    assert accepted.tokens == [11, 12] and accepted.reason is StopReason.EOS
    other = make_seq("broken", [5, 6, 7], max_tokens=10, arrival=1)
    sched.add(other)
    sched.schedule()
    other.matcher = FakeMatcher(length=5, limit=50)  # type: ignore[assignment]
    with pytest.raises(GrammarRefused):
        sched.accept(other, [11, 60])


def test_finish_frees_everything_and_may_be_called_twice() -> None:
    sched = scheduler()
    seqs = [make_seq(f"j{i}", list(range(10, 20)), arrival=i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    play(sched)
    for seq in seqs:
        sched.finish(seq)
        sched.finish(seq)
    assert sched.idle and sched.blocks.used_blocks == 0
    assert all(s.state is SequenceState.FINISHED for s in seqs)
