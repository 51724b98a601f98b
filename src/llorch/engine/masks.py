"""Each step's allowed-token masks for the constrained rows, computed beside the forward pass.

A constrained job's grammar state already knows, before the forward pass starts, which
tokens it allows next. So the masks are filled on a thread of their own while the
model runs (llguidance and the C forward pass both release the GIL), and applied to
those rows' logits, in place, before sampling: a disallowed token's logit becomes
-inf, and every sampler setting then only ever sees allowed tokens. A row's mask
depends on its own grammar state only, so a constrained row gets the same token alone
or batched.
"""

from __future__ import annotations

from collections.abc import Sequence as Rows
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from llorch.kernels.rows import address, mask_rows

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from torch import Tensor

    from llorch.engine.sequence import Sequence

    Logits = Tensor | np.ndarray


def fill_mask(matcher: LLMatcher, row: Tensor | np.ndarray) -> None:
    """One job's allowed tokens into `row` (int32, contiguous, on the CPU), written by the library itself.

    llguidance.torch offers this too, but importing it pulls in torch's compiler stack: 3 s of start-up.
    """
    matcher.unsafe_compute_mask_ptr(address(row), row.nbytes)


class PendingMasks:
    """One step's masks, being filled: which job has which row of the bitmask."""

    def __init__(self, rows: dict[str, int], bitmask: Future[np.ndarray] | None) -> None:
        self._rows = rows
        self._bitmask = bitmask

    def apply(self, sampling: Rows[Sequence], logits: Logits, rows: Rows[int]) -> None:
        """Set each constrained row of `logits` (row rows[i] is sampling[i]'s) to -inf outside its grammar."""
        if self._bitmask is None:
            return
        bitmask = self._bitmask.result()
        pairs = [(rows[i], self._rows[seq.job_id]) for i, seq in enumerate(sampling) if seq.job_id in self._rows]
        if pairs:
            mask_rows(logits, [i for i, _ in pairs], bitmask[[row for _, row in pairs]])


NO_MASKS = PendingMasks({}, None)


def mask_proposals(matcher: LLMatcher, draft: list[int], logits: Logits, words: int) -> None:
    """Mask the rows after a constrained row's proposals (logits[j] follows draft[j]) by its grammar in
    the state after the proposals up to j, on a copy of the job's matcher: a matcher that consumes past
    its grammar's end is left in an error that rolling back does not clear.

    The proposals were checked against the grammar when they were made; should one still be refused,
    or the grammar end before the last, the rows from there stay unmasked and are never read: the row
    before forbids that proposal, or the sequence ends there.
    """
    probe = matcher.deep_copy()
    bitmask = np.empty((len(draft), words), dtype=np.int32)
    consumed = 0
    for token in draft:
        if probe.is_stopped() or not probe.consume_token(token):
            break
        fill_mask(probe, bitmask[consumed])
        consumed += 1
    if consumed:
        mask_rows(logits, list(range(consumed)), bitmask[:consumed])


class GrammarMasks:
    def __init__(self, vocab_size: int) -> None:
        self.words = (vocab_size + 31) // 32  # one bit per token id, 32 to an int32
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="llorch-grammar")

    def begin(self, sampling: Rows[Sequence]) -> PendingMasks:
        """Start filling the masks of the rows that sample this step and carry a grammar."""
        constrained = [seq for seq in sampling if seq.matcher is not None]
        if not constrained:
            return NO_MASKS
        matchers = [seq.matcher for seq in constrained]

        def fill() -> np.ndarray:  # host memory whatever the logits' device: the mask is made on the CPU
            bitmask = np.empty((len(matchers), self.words), dtype=np.int32)
            for row, matcher in enumerate(matchers):
                fill_mask(matcher, bitmask[row])
            return bitmask

        rows = {seq.job_id: row for row, seq in enumerate(constrained)}
        return PendingMasks(rows, self._thread.submit(fill))
