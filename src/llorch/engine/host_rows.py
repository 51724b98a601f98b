"""The sampler's and the scorer's row math on numpy arrays in host memory, without torch.

The CPU worker's C step hands its logits over as a numpy float32 array; importing torch
only to reduce them would cost a second of start-up. Each function here is the torch op
the sampler or scorer uses on a tensor, step for step, so a row gets the same token either
way: the same float32 operations (a Python number meets float32 as float32 in both), torch's
double-precision running sums, its NaN propagation, and what its searchsorted and topk do
with NaN. Sums that torch keeps in float32 are kept in float64 here: the log-probabilities
differ from torch's at float32 rounding only.
"""

from __future__ import annotations

import numpy as np

_QUIET = {"invalid": "ignore", "divide": "ignore", "over": "ignore"}  # inf - inf and log(0), as torch: no warning


def log_softmax_at(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log_softmax(row)[ids] in float64, as torch.log_softmax gives it: x - max - log(sum(e^(x - max))), so a row
    holding a NaN or +inf, or holding only -inf, is NaN throughout."""
    with np.errstate(**_QUIET):
        high = row.max()
        normalizer = np.log(np.exp(row - high).sum(dtype=np.float64))
        return (row[ids] - high).astype(np.float64) - normalizer


def logprobs(row: np.ndarray, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """A row's log-probability at `token` and its `k` likeliest tokens with theirs, as the sampler reports them."""
    row = row.astype(np.float32, copy=False)
    top = top_ids(row, k)  # the order of the logits is that of their log-probabilities
    values = log_softmax_at(row, np.concatenate([[token], top])).tolist()
    return values[0], tuple(zip(top.tolist(), values[1:], strict=True))


def logsumexp(row: np.ndarray) -> float:
    """torch.logsumexp of a row: an infinite maximum is not subtracted, so a row holding +inf gives inf and one
    of only -inf gives -inf (a NaN gives NaN)."""
    with np.errstate(**_QUIET):
        high = row.max()
        shift = np.float32(0.0) if np.isinf(high) else high
        return float(np.log(np.exp(row - shift).sum(dtype=np.float64)) + float(shift))


def top_ids(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k largest values, largest first, as torch.topk ranks them: NaN above everything. Equal
    values come in index order (torch's order among them is its own); k past the row is an error, as in torch."""
    if not 0 <= k <= values.size:
        raise ValueError(f"top {k} of a row of {values.size} values")
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if np.isnan(values.max()):  # max propagates NaN: one cheap pass rules it out
        nan = np.isnan(values)
        first = np.flatnonzero(nan)[:k]
        if first.size == k:
            return first
        others = np.flatnonzero(~nan)
        return np.concatenate([first, others[top_ids(values[others], k - first.size)]])
    kth = np.partition(values, values.size - k)[values.size - k]  # the k-th largest
    above = np.flatnonzero(values > kth)
    above = above[np.argsort(-values[above], kind="stable")]
    return np.concatenate([above, np.flatnonzero(values == kth)[: k - above.size]])


def softmax(x: np.ndarray) -> np.ndarray:
    with np.errstate(**_QUIET):
        weights = np.exp(x - x.max())
        return weights / weights.sum()


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The sampler's filtered distribution of a row (temperature, then top_k, top_p, min_p), as its torch form."""
    with np.errstate(**_QUIET):
        x = logits.astype(np.float32, copy=False)
        x = (x - x.max()) / temperature
        if 0 < top_k < x.size:
            kth = np.partition(x, x.size - top_k)[x.size - top_k]
            x = np.where(x < kth, np.float32(-np.inf), x)
        probs = softmax(x)
        if top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            sorted_probs = probs[order]
            mass_before = _cumsum(sorted_probs) - sorted_probs
            drop_sorted = mass_before >= top_p
            drop_sorted[0] = False
            drop = np.empty_like(drop_sorted)
            drop[order] = drop_sorted
            probs = np.where(drop, np.float32(0.0), probs)
        if min_p > 0.0:
            probs = np.where(probs < min_p * probs.max(), np.float32(0.0), probs)
        return probs / probs.sum()


def draw(probs: np.ndarray, fraction: float) -> int:
    """The first index where the cumulative distribution passes `fraction` of its mass (the last when it never
    does, as for NaN probabilities: searchsorted ranks NaN above every number, in torch and numpy alike)."""
    cumulative = _cumsum(probs)
    target = cumulative[-1:] * fraction
    return min(int(np.searchsorted(cumulative, target, side="right")[0]), probs.size - 1)


def _cumsum(x: np.ndarray) -> np.ndarray:
    """torch.cumsum of float32 on the CPU: a double running sum, each prefix rounded to float32."""
    return np.cumsum(x, dtype=np.float64).astype(np.float32)
