"""Verification of a row's proposed tokens: keep what the model itself would have chosen.

A verifying row has logits for k + 1 positions: after its last token and after each of
its k proposals. Position by position, the row's own sampler chooses a token exactly as
it would without speculation (the argmax, or the draw at the next number of the job's
random stream, after its penalties); the proposal at that position is kept while it is
that choice, and the first choice that differs (or the one after the last proposal)
ends the row's tokens for this step.

So the tokens are the ones decoding without speculation gives, for greedy and for
sampled rows alike, with the same seed: the logits of a position do not depend on how
the rows were stepped (the C step's batch invariance), and each kept token uses one
number of the stream, as it would one step at a time. For a sampled row this is the
standard speculative rule for a proposal that is a single token: it is kept with the
target's probability of it, and otherwise the token comes from the target's
distribution without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llorch.engine.sampler import Sampled, SamplerState, argmax, plain_greedy, sample_batch

if TYPE_CHECKING:
    import numpy as np
    from torch import Tensor


def verify(logits: Tensor | np.ndarray, draft: list[int], state: SamplerState, logprobs: int | None) -> list[Sampled]:
    """The tokens a row keeps from `logits` [len(draft) + 1, vocab]: the proposals its sampler
    chooses too, then its own next choice. The sampler state has recorded every kept proposal."""
    if logprobs is None and plain_greedy(state):
        choices = argmax(logits).tolist()  # every position at once: no penalty depends on the ones before
        kept: list[Sampled] = []
        for position, choice in enumerate(choices):
            kept.append(Sampled(choice))
            if position == len(draft) or choice != draft[position]:
                break
            state.accept(choice)
        return kept
    kept = []
    for position in range(len(draft) + 1):
        sampled = sample_batch(logits[position : position + 1], [state], [logprobs])[0]
        kept.append(sampled)
        if position == len(draft) or sampled.token_id != draft[position]:
            break
        state.accept(sampled.token_id)  # the next position's penalties and min_tokens count it
    return kept
