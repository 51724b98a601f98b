"""Speculative decoding's proposals: n-gram lookup in a sequence's own tokens, and how many to propose.

Decode reads every weight once per step, whatever the number of rows. A decoding row
that feeds its last token plus k proposed tokens gets logits for all k + 1 positions
from one step; the core keeps the proposals the model itself would have chosen (see
verify.py), so each accepted one is a token for a fraction of a step's cost.

Proposals come from the text itself: the last n tokens (n from NGRAM_MAX down to
NGRAM_MIN) are looked up in the prompt and the output so far, and the tokens that
followed their most recent earlier occurrence are proposed. Answering from a given
text, editing code or filling JSON repeats long runs of the context; free text
rarely does, and a wrong proposal costs part of a step. So each row adapts:
- its proposal length doubles (up to `max_tokens`) while every proposal is kept, and
  falls back to what was kept plus one when one is not;
- after proposals of which none was kept it stops proposing for 1, 3, 7, ... steps
  (at most MAX_PAUSE), so free text pays for a few probes, not for every step.

The scheduler asks only while a step has at most `max_rows` decoding rows: beyond
that a step is bound by arithmetic, not by reading the weights, and extra rows are
no longer nearly free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NGRAM_MAX = 4
NGRAM_MIN = 2
FIRST_LENGTH = 4  # a row's first proposals; it grows from there while they are kept
MAX_PAUSE = 32  # steps without proposals, at most, after proposals of which none was kept
SPECULATIVE_MAX_ROWS = 2  # decoding rows in a step beyond which nobody proposes (measured: bench/speculative.py)


@dataclass
class RowSpeculation:
    """One sequence's proposal state: its tokens as an array (for lookup), its proposal length and pause."""

    tokens: np.ndarray = field(default_factory=lambda: np.empty(256, dtype=np.int64))
    synced: int = 0  # tokens[:synced] mirror the sequence's tokens
    length: int = FIRST_LENGTH
    misses: int = 0  # verifications in a row that kept no proposal
    paused: int = 0  # steps left without proposals
    proposed: int = 0  # this job's totals
    accepted: int = 0
    cache: object = None  # what a proposer keeps for the row between steps (a draft model's KV)

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The sequence's tokens as an int64 array (only the new ones are copied)."""
        count = len(token_ids)
        if count > len(self.tokens):
            grown = np.empty(max(count, 2 * len(self.tokens)), dtype=np.int64)
            grown[: self.synced] = self.tokens[: self.synced]
            self.tokens = grown
        if count > self.synced:
            self.tokens[self.synced : count] = token_ids[self.synced :]
            self.synced = count
        return self.tokens[:count]


@dataclass(frozen=True)
class Proposal:
    """A decoding row asked for proposals: its state, its tokens, and how many it may have at most."""

    state: RowSpeculation
    token_ids: list[int]
    limit: int


def continuation(tokens: np.ndarray, limit: int) -> np.ndarray:
    """`limit` tokens that followed the most recent earlier occurrence of the longest suffix
    (NGRAM_MAX .. NGRAM_MIN tokens) found again in `tokens`; empty when none is. Where that
    occurrence is closer to the end than `limit`, the text since it is repeated."""
    count = len(tokens)
    for n in range(min(NGRAM_MAX, count - 1), NGRAM_MIN - 1, -1):
        tail = tokens[count - n :]
        # Starts p with p + n < count: the occurrence is earlier and has a token after it.
        starts = np.flatnonzero(tokens[: count - n] == tail[0])
        for j in range(1, n):
            if not len(starts):
                break
            starts = starts[tokens[starts + j] == tail[j]]
        if len(starts):
            after = int(starts[-1]) + n
            period = count - after  # the text repeats with this period from the occurrence on
            if period >= limit:
                return tokens[after : after + limit]
            return np.resize(tokens[after:], limit)  # a run shorter than `limit`: it goes on repeating
    return tokens[:0]


class NgramSpeculation:
    """Proposes tokens for decoding rows from their own text and adapts to what verification keeps."""

    resident_bytes = 0  # on the device, beside the target's weights and KV pool

    def __init__(self, max_tokens: int, max_rows: int) -> None:
        self.max_tokens = max_tokens  # proposals per row and step, at most
        self.max_rows = max_rows  # decoding rows a step may have for anyone to propose

    def propose_rows(self, rows: list[Proposal]) -> list[list[int]]:
        """Each row's proposed next tokens (at most its limit; none is fine)."""
        return [self.propose(row.state, row.token_ids, row.limit) for row in rows]

    def forget(self, state: RowSpeculation) -> None:
        """The row stopped running (finished or preempted): let go of what was kept for it."""

    def propose(self, state: RowSpeculation, token_ids: list[int], limit: int) -> list[int]:
        """At most `limit` proposed next tokens for a sequence whose tokens are `token_ids`."""
        limit = self.wanted(state, limit)
        return continuation(state.sync(token_ids), limit).tolist() if limit else []

    def wanted(self, state: RowSpeculation, limit: int) -> int:
        """How many tokens the row proposes this step (0 while it pauses, which this step counts)."""
        if state.paused:
            state.paused -= 1
            return 0
        return max(0, min(limit, state.length, self.max_tokens))

    def verified(self, state: RowSpeculation, proposed: int, accepted: int) -> None:
        """`accepted` of `proposed` tokens were kept: adapt the row's proposal length and pause."""
        state.proposed += proposed
        state.accepted += accepted
        if accepted == proposed:
            state.length, state.misses = min(2 * state.length, self.max_tokens), 0
        elif accepted:
            state.length, state.misses = accepted + 1, 0
        else:
            state.length, state.misses = 1, state.misses + 1
            state.paused = min(2**state.misses - 1, MAX_PAUSE)
