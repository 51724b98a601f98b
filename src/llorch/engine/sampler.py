"""Next-token choice from one sequence's logits, on the device.

Order: repetition penalty, presence/frequency penalties, temperature, top-k, top-p, min-p, then a draw from the
sequence's own seeded generator. Temperature 0 is greedy. Only the chosen id
leaves the device (as a 0-d tensor the engine turns into an int).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llorch.engine.request import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    # torch seeds are signed 64-bit; fold the uint64 seed into that range losslessly.
    generator.manual_seed(seed - (1 << 64) if seed >= 1 << 63 else seed)
    return generator


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Make tokens already in the context less (penalty > 1) or more (< 1) likely."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits.gather(0, seen)
    logits = logits.clone()
    logits.scatter_(0, seen, torch.where(picked > 0, picked / penalty, picked * penalty))
    return logits


def apply_presence_frequency(logits: Tensor, counts: Tensor | None, params: SamplingParams) -> Tensor:
    """OpenAI's penalties: subtract frequency * count and presence * (count > 0) per token."""
    if counts is None or (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0):
        return logits
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)


def filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a sampled token is drawn from, after temperature and filters."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[0] = False
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(
    logits: Tensor,
    params: SamplingParams,
    seen: Tensor,
    generator: torch.Generator | None,
    generated_counts: Tensor | None = None,
) -> Tensor:
    """One token id (0-d tensor on the device) from 1-d `logits` over the vocabulary."""
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    logits = apply_presence_frequency(logits, generated_counts, params)
    if params.greedy:
        return torch.argmax(logits)
    return torch.multinomial(filtered_probs(logits, params), 1, generator=generator)[0]
