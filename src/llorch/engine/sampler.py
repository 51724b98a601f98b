"""Next-token choice for a whole step's rows, on the device, with one host transfer.

Per row, in order: logit bias, repetition penalty, presence/frequency penalties, temperature,
top-k, top-p, min-p, then a draw. Temperature 0 is greedy (argmax).

Each sequence owns a SamplerState: its parameters, its own random stream and the
history its penalties need. The random stream is a counter-based generator on the
host (Philox, keyed by the job's seed) that gives one uniform number per drawn
token; the draw is the inverse CDF of the row's filtered distribution at that
number. So a row's token depends on its own logits and its own stream only: the
same seed gives the same tokens alone or in any batch, and no per-row generator
object has to live on the device. Everything else runs row by row on the device,
and the chosen ids (with any requested log-probabilities) leave it in one transfer.

Logits may also be a numpy float32 array in host memory (the CPU worker's C step): then
the state's history is numpy too (a SamplerState made with no device), the row math is
engine.host_rows's, and torch is never imported. A row gets the same token either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llorch.engine import arrays, host_rows
from llorch.engine.penalties import penalized
from llorch.engine.request import SamplingParams
from llorch.kernels.rows import argmax_rows, sample_row, sample_rows

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    Array = Tensor | np.ndarray

# A draw lands strictly below the total mass, whatever float32 rounding does to u * total.
_BELOW_ONE = 1.0 - 2.0**-20
# Accepted values below this act as this: dividing float32 logits by less overflows (1e-300 is 0 in
# float32, and 0/0 is NaN). At 1e-6 a temperature is already greedy.
MIN_TEMPERATURE = 1e-6


class SamplerState:
    """One sequence's sampler: parameters, random stream, and the history penalties read (on `device`, or in
    numpy arrays when it is None: the state of rows whose logits are numpy arrays, and only of those)."""

    def __init__(self, params: SamplingParams, seed: int, prompt_ids: Sequence[int], vocab_size: int,
                 device: torch.device | None, eos_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.device = device
        self._stream = np.random.Generator(np.random.Philox(seed))
        # Repetition penalty: every id in the context (prompt and output), grown as tokens come.
        self._seen: Array | None = None
        self._seen_count = 0
        if params.repetition_penalty != 1.0:
            prompt = arrays.ids(list(prompt_ids), device)
            self._seen = arrays.grown(prompt, len(prompt_ids), max(64, 2 * len(prompt_ids)))
            self._seen_count = len(prompt_ids)
        # Presence/frequency penalties: how often each id was generated (the prompt does not count).
        self.counts: Array | None = None
        if params.presence_penalty or params.frequency_penalty:
            self.counts = arrays.zeros(vocab_size, device)
        # Logit bias: the named ids and what is added to their logits.
        self.bias: tuple[Array, Array] | None = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias = (arrays.ids(ids, device), arrays.floats(values, device))
        # min_tokens: the end-of-generation ids, masked until that many tokens are out.
        self.generated = 0
        self.eos: Array | None = None
        self.eos_list: list[int] = []  # the same ids, to look a token up in
        if params.min_tokens > 0 and eos_ids:
            self.eos_list = sorted(eos_ids)
            self.eos = arrays.ids(self.eos_list, device)

    @property
    def eos_blocked(self) -> bool:
        return self.eos is not None and self.generated < self.params.min_tokens

    @property
    def seen(self) -> Array | None:
        return None if self._seen is None else self._seen[: self._seen_count]

    def uniform(self) -> float:
        """The next number of this sequence's random stream, in [0, 1)."""
        return float(self._stream.random())

    def accept(self, token_id: int) -> None:
        """Record a generated token in the history the penalties read."""
        self.generated += 1
        if self._seen is not None:
            if self._seen_count == len(self._seen):
                self._seen = arrays.grown(self._seen, self._seen_count, 2 * len(self._seen))
            self._seen[self._seen_count] = token_id
            self._seen_count += 1
        if self.counts is not None:
            self.counts[token_id] += 1


@dataclass(frozen=True)
class Sampled:
    """A chosen token, with its log-probability and the top alternatives when they were asked for."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def filtered_probs(logits: Array, params: SamplingParams) -> Array:
    """The distribution a sampled token is drawn from (1-d), after temperature and filters."""
    if isinstance(logits, np.ndarray):
        return host_rows.filtered_probs(logits, max(params.temperature, MIN_TEMPERATURE), params.top_k,
                                        params.top_p, params.min_p)
    import torch

    logits = logits.float()
    # Shifted by the maximum first, so a tiny temperature gives -inf, never inf - inf = NaN.
    logits = (logits - logits.max()) / max(params.temperature, MIN_TEMPERATURE)
    if 0 < params.top_k < logits.numel():
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


def draw(probs: Array, uniform: float) -> Array | int:
    """The token (0-d tensor, or an int for a numpy row) where the cumulative distribution first passes
    `uniform` of its mass."""
    if isinstance(probs, np.ndarray):
        return host_rows.draw(probs, uniform * _BELOW_ONE)
    import torch

    cumulative = torch.cumsum(probs, dim=-1)
    target = cumulative[-1:] * (uniform * _BELOW_ONE)
    return torch.searchsorted(cumulative, target, right=True)[0].clamp_(max=probs.numel() - 1)


def sample(logits: Array, params: SamplingParams, uniform: float) -> Array | int:
    """One row's token (0-d tensor, or an int for a numpy row) for a `uniform` draw: in one C pass on the CPU,
    with torch elsewhere and the array's own ops for a row the C pass leaves to them (a NaN or an infinity)."""
    if in_c(logits):
        token = sample_row(logits, *c_setting(params, uniform))
        if token is not None:
            return token if isinstance(logits, np.ndarray) else as_tensor(token)
    return draw(filtered_probs(logits, params), uniform)


def in_c(logits: Array) -> bool:
    """Whether the C sampler reads these logits: float32 in host memory (numpy, or torch on the CPU)."""
    if isinstance(logits, np.ndarray):
        return logits.dtype == np.float32
    import torch

    return logits.device.type == "cpu" and logits.dtype == torch.float32


def as_tensor(token: int) -> Array:
    """A C-drawn token as the 0-d tensor the torch path gives."""
    import torch

    return torch.tensor(token)


def c_setting(params: SamplingParams, uniform: float) -> tuple[float, int, float, float, float]:
    """A draw's arguments to the C sampler (kernels.rows.sample_row)."""
    return max(params.temperature, MIN_TEMPERATURE), params.top_k, params.top_p, params.min_p, uniform * _BELOW_ONE


def sampled_together(logits: Array, states: Sequence[SamplerState]) -> dict[int, Array | int]:
    """The tokens of the rows drawn from the model's own logits (sampled, nothing changing the logits first),
    in one C call that shares them among the step's threads, by row; {} unless there are several, on
    float32 CPU logits. Why: one after another, a batch's sampled rows were most of the engine's time a step
    at 16 streams (0.2 ms each at 262k tokens)."""
    rows = [i for i, state in enumerate(states) if plain_sampled(state)]
    if len(rows) < 2 or not in_c(logits):
        return {}
    uniforms = [states[i].uniform() for i in rows]
    tokens = sample_rows(logits, rows, [c_setting(states[i].params, u) for i, u in zip(rows, uniforms, strict=True)])
    chosen: dict[int, Array | int] = {}
    for i, token, uniform in zip(rows, tokens, uniforms, strict=True):
        if token is None:  # a NaN or an infinity: the row's own ops decide, as sample's
            chosen[i] = draw(filtered_probs(logits[i], states[i].params), uniform)
        else:
            chosen[i] = token if isinstance(logits, np.ndarray) else as_tensor(token)
    return chosen


def sample_batch(logits: Array, states: Sequence[SamplerState], logprobs: Sequence[int | None] = (),
                 best: list[int] | None = None) -> list[Sampled]:
    """One token per row of `logits` [R, vocab], row i drawn with `states[i]`.

    `logprobs[i]` (when given and not None) asks for row i's chosen-token log-probability
    under the model's own distribution (before penalties and filters) and that many
    top alternatives. `best`, when given, is each row's argmax, found already.
    """
    if all(k is None for k in logprobs) and all(plain_greedy(state) for state in states):
        return [Sampled(t) for t in (best if best is not None else argmax_list(logits))]  # the common case
    rows = logits.shape[0]
    wanted = list(logprobs) + [None] * (rows - len(logprobs))
    greedy = [s.params.greedy for s in states]
    chosen: list[Array | int] = []
    plain = [i for i in range(rows) if plain_greedy(states[i])]
    # Indexing copies each row (1 MB at 262k tokens): only when some rows are not plain greedy.
    greedy_logits = logits if len(plain) == rows else logits[plain]
    by_row = dict(zip(plain, argmax(greedy_logits) if plain else [], strict=True)) | sampled_together(logits, states)
    for i, state in enumerate(states):
        if i in by_row:
            chosen.append(by_row[i])
            continue
        if greedy[i] and state.seen is None and state.counts is None and state.bias is None:
            # Greedy with only end-of-generation ids masked (min_tokens, ignore_eos): the row's own argmax stands
            # unless it is one of them, so the masked copy (1 MB at 262k tokens, 0.7 ms) is made only then.
            best = logits[i].argmax()
            if int(best) not in state.eos_list:
                chosen.append(best)
                continue
        row = penalized(logits[i], state)
        chosen.append(row.argmax() if greedy[i] else sample(row, state.params, state.uniform()))
    if isinstance(logits, np.ndarray):
        return [Sampled(int(token)) if k is None else Sampled(int(token), *host_rows.logprobs(logits[i], int(token), k))
                for i, (token, k) in enumerate(zip(chosen, wanted, strict=True))]
    import torch

    ids = torch.stack(chosen)  # type: ignore[arg-type]
    extras: list[Tensor] = []
    for i, k in enumerate(wanted):
        if k is None:
            continue
        row_logprobs = torch.log_softmax(logits[i].float(), dim=-1)
        values, top_ids = torch.topk(row_logprobs, k) if k else (row_logprobs[:0], row_logprobs[:0].long())
        extras.extend([row_logprobs[ids[i]].reshape(1), values, top_ids.to(row_logprobs.dtype)])
    # The one transfer: ids (exact in float64) and every requested log-probability.
    host = torch.cat([ids.to(torch.float64), *(e.to(torch.float64) for e in extras)]).tolist()
    results, at = [], rows
    for i in range(rows):
        token = int(host[i])
        k = wanted[i]
        if k is None:
            results.append(Sampled(token))
            continue
        logprob, values, top = host[at], host[at + 1 : at + 1 + k], host[at + 1 + k : at + 1 + 2 * k]
        at += 1 + 2 * k
        results.append(Sampled(token, logprob, tuple((int(t), v) for t, v in zip(top, values, strict=True))))
    return results


def argmax_list(logits: Array) -> list[int]:
    """Each row's argmax as a list: straight from C for float32 CPU logits (no array in between)."""
    if isinstance(logits, np.ndarray) and logits.dtype == np.float32:
        return argmax_rows(logits)
    return argmax(logits).tolist()


def argmax(logits: Array) -> Array:
    """Each row's argmax: in C on the CPU (torch's takes 0.25 ms a row at 262k), torch's elsewhere."""
    if isinstance(logits, np.ndarray):
        if logits.dtype == np.float32:
            return np.array(argmax_rows(logits), dtype=np.int64)
        return logits.argmax(axis=-1)
    import torch

    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.tensor(argmax_rows(logits), dtype=torch.long)
    return logits.argmax(dim=-1)


def plain_sampled(state: SamplerState) -> bool:
    """Sampled with nothing that changes the logits first: the row is drawn from the model's own logits."""
    return (not state.params.greedy and state.seen is None and state.counts is None and state.bias is None
            and not state.eos_blocked)


def plain_greedy(state: SamplerState) -> bool:
    """Greedy with nothing that changes the logits first: the row's token is its argmax."""
    return (state.params.greedy and state.seen is None and state.counts is None and state.bias is None
            and not state.eos_blocked)
