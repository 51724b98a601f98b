"""The logits a sampled row is drawn from: its logit bias, repetition, presence and frequency penalties and a
held end token applied to the model's own, on the device, or on numpy rows in host memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

    from llorch.engine.request import SamplingParams

    Array = Tensor | np.ndarray


class Penalized(Protocol):
    """What the penalties read of a sequence's sampler (engine.sampler.SamplerState)."""

    params: SamplingParams
    bias: tuple[Array, Array] | None
    counts: Array | None
    eos: Array | None

    @property
    def seen(self) -> Array | None: ...

    @property
    def eos_blocked(self) -> bool: ...

# Accepted values below this act as this: dividing float32 logits by less overflows (1e-300 is 0 in float32,
# and 0/0 is NaN). At 1e-6 a penalty is already decisive.
MIN_REPETITION_PENALTY = 1e-6


def apply_repetition_penalty(logits: Array, seen: Array | None, penalty: float) -> Array:
    """Make tokens already in the context less (penalty > 1) or more (< 1) likely."""
    if penalty == 1.0 or seen is None or len(seen) == 0:
        return logits
    penalty = max(penalty, MIN_REPETITION_PENALTY)
    if isinstance(logits, np.ndarray):
        picked = logits[seen]
        logits = logits.copy()
        logits[seen] = np.where(picked > 0, picked / penalty, picked * penalty)
        return logits
    import torch

    picked = logits.gather(0, seen)
    logits = logits.clone()
    logits.scatter_(0, seen, torch.where(picked > 0, picked / penalty, picked * penalty))
    return logits


def apply_presence_frequency(logits: Array, counts: Array | None, params: SamplingParams) -> Array:
    """OpenAI's penalties: subtract frequency * count and presence * (count > 0) per token."""
    if counts is None or (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0):
        return logits
    present = (counts > 0).astype(logits.dtype) if isinstance(counts, np.ndarray) else (counts > 0).to(logits.dtype)
    return logits - params.frequency_penalty * counts - params.presence_penalty * present


def penalized(logits: Array, state: Penalized) -> Array:
    """One row's logits after the bias and penalties its parameters ask for."""
    host = isinstance(logits, np.ndarray)
    if state.bias is not None:
        if host:
            logits = logits.copy()
            np.add.at(logits, state.bias[0], state.bias[1].astype(logits.dtype))
        else:
            logits = logits.index_add(0, state.bias[0], state.bias[1].to(logits.dtype))
    logits = apply_repetition_penalty(logits, state.seen, state.params.repetition_penalty)
    logits = apply_presence_frequency(logits, state.counts, state.params)
    if state.eos_blocked:
        if host:
            logits = logits.copy()
            logits[state.eos] = -np.inf
        else:
            logits = logits.index_fill(0, state.eos, float("-inf"))  # type: ignore[arg-type]
    return logits
