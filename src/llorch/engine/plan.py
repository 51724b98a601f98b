"""What one engine step computes, as the scheduler plans it and accepts its results."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from llorch.engine.request import StopReason
from llorch.engine.sequence import Sequence


@dataclass
class Chunk:
    seq: Sequence
    tokens: int  # how many of the sequence's pending tokens this step feeds

    @property
    def completes(self) -> bool:
        """After this chunk every known token is cached: the next token is sampled from it."""
        return self.tokens == self.seq.pending

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
