"""What one engine step computes, as the scheduler plans it and accepts its results, and what it did to each job."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llorch.engine.request import ErrorCode, StopReason
from llorch.engine.sequence import Sequence

if TYPE_CHECKING:
    from llorch.engine.sampler import Sampled


@dataclass
class Chunk:
    seq: Sequence
    tokens: int  # how many of the sequence's pending tokens this step feeds

    @property
    def completes(self) -> bool:
        """After this chunk every known token is cached: the next token is sampled from it."""
        return self.tokens == self.seq.pending

    @property
    def prompt(self) -> int:
        """How many of its tokens are prompt rows (runner.ChunkInput.prompt, Sequence.prompt_rows): the same
        for a token whatever chunk, step or batch it comes in, so a job's tokens never depend on its schedule."""
        return max(0, min(self.tokens, self.seq.prompt_rows - self.seq.blocks.computed))

    @property
    def draft(self) -> list[int]:
        """Proposed tokens fed after the known ones, for this step to verify."""
        return self.seq.draft if self.completes else []


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)  # single tokens first, then prompt chunks
    admitted: list[Sequence] = field(default_factory=list)  # running for the first time
    resumed: list[Sequence] = field(default_factory=list)  # running again after a preemption
    preempted: list[Sequence] = field(default_factory=list)
    prefix_hit_tokens: int = 0


@dataclass(frozen=True)
class Accepted:
    """What a row's tokens of one step became."""

    tokens: list[int]  # appended to the sequence, in order (an end-of-generation token never is)
    reason: StopReason | None  # the sequence ended with them (None: it goes on)


def logit_rows(sampling: list[Sequence], keep: Iterable[int], first_only: bool = False) -> list[int]:
    """The logits rows of sampling[i] for each i in `keep` (all its rows, or its sampling row only), where
    each sequence has one row plus one per proposed token, in turn."""
    firsts, at = [], 0
    for seq in sampling:
        firsts.append(at)
        at += 1 + len(seq.draft)
    if first_only:
        return [firsts[i] for i in keep]
    return [row for i in keep for row in range(firsts[i], firsts[i] + 1 + len(sampling[i].draft))]


Scores = list[tuple[float, tuple[tuple[int, float], ...]]]


@dataclass
class RowOutput:
    """One sampling row of a step: what was drawn, what the scheduler appended, and whether that ended it."""

    seq: Sequence
    sampled: list[Sampled]
    accepted: list[int]
    reason: StopReason | None


@dataclass
class StepOutput:
    """What one step did to each job, in the order its events must go out: scores, tokens, ends."""

    admitted: list[Sequence] = field(default_factory=list)  # running for the first time
    scores: list[tuple[Sequence, int, Scores]] = field(default_factory=list)  # (job, first prompt position, scores)
    rows: list[RowOutput] = field(default_factory=list)
    finished: list[tuple[Sequence, StopReason]] = field(default_factory=list)  # ended without a row (max_tokens=0)
    pooled: list[tuple[Sequence, tuple[float, ...]]] = field(default_factory=list)  # a pooled job's vector or score
    failed: list[tuple[Sequence, ErrorCode, str]] = field(default_factory=list)
    ran: bool = False  # the model computed something (False: every running job waits, e.g. for its reader)
