"""Prompt scoring: the log-probability of each prompt token given the tokens before it.

Evaluations (multiple-choice loglikelihood) read these. The logits of a chunk's
scored rows are reduced on the device to each row's chosen-token log-probability and
its top-k alternatives; only those leave it, in one transfer, and the logits are
dropped with the step. Logits (and hidden states) may also be numpy arrays in host memory,
the C step's: those are reduced with numpy, and torch is never imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Union

import numpy as np

from llorch.engine import host_rows

if TYPE_CHECKING:
    from torch import Tensor

Scores = list[tuple[float, tuple[tuple[int, float], ...]]]


def score_rows(logits: Tensor | np.ndarray, targets: list[int], top: int) -> Scores:
    """Per row of `logits` [R, vocab]: log-softmax at `targets[r]`, and the `top` best (id, log-probability)."""
    rows = logits.shape[0]
    if rows == 0:
        return []
    if isinstance(logits, np.ndarray):
        return [_score_row(row.astype(np.float32, copy=False), target, top)
                for row, target in zip(logits, targets, strict=True)]
    import torch

    logits = logits.float()
    # log p = logit - logsumexp: the top-k of the logits are the top-k of the log-probabilities, so no
    # second [R, vocab] tensor is made.
    normalizer = torch.logsumexp(logits, dim=-1)
    target_ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
    chosen = logits.gather(1, target_ids[:, None])[:, 0] - normalizer
    parts = [chosen.double()]
    if top:
        values, ids = torch.topk(logits, top, dim=-1)
        parts += [(values - normalizer[:, None]).double().flatten(), ids.double().flatten()]
    host = torch.cat(parts).tolist()
    values_at, ids_at = rows, rows + rows * top  # where the top values and ids start in `host`
    results = []
    for r in range(rows):
        first = r * top
        results.append((host[r], tuple((int(host[ids_at + first + j]), host[values_at + first + j])
                                       for j in range(top))))
    return results


def _score_row(row: np.ndarray, target: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """One numpy row's score, as torch's: log p = logit - logsumexp (torch.logsumexp's, infinities and all)."""
    normalizer = host_rows.logsumexp(row)
    ids = host_rows.top_ids(row, top).tolist()
    return float(row[target]) - normalizer, tuple((i, float(row[i]) - normalizer) for i in ids)


# A pooled job's output from its prompt's last row (a torch tensor or a numpy array).
Pool = Callable[[Union["Tensor", np.ndarray]], tuple[float, ...]]


def rank_pool(tokens: tuple[int, int]) -> Pool:
    """A decoder reranker's relevance: the probability of its "yes" token against its "no" (`tokens`: no, yes)
    at the prompt's last position, as Qwen3-Reranker scores."""
    def pool(logits: Tensor | np.ndarray) -> tuple[float, ...]:
        pair = logits[list(tokens)]
        if isinstance(pair, np.ndarray):
            return (float(host_rows.softmax(pair.astype(np.float32))[1]),)
        import torch

        return (float(torch.softmax(pair.float(), dim=-1)[1]),)

    return pool


def last_token_pool(normalize: bool) -> Pool:
    """A decoder embedding model's vector: the last prompt token's final hidden state (Qwen3-Embedding's)."""
    def pool(hidden: Tensor | np.ndarray) -> tuple[float, ...]:
        if isinstance(hidden, np.ndarray):
            vector = hidden.astype(np.float32)
            if normalize:  # as torch's normalize: divided by the norm, or by 1e-12 when that is smaller
                vector = vector / max(np.linalg.norm(vector), np.float32(1e-12))
            return tuple(vector.tolist())
        import torch

        vector = hidden.float()
        return tuple((torch.nn.functional.normalize(vector, dim=-1) if normalize else vector).tolist())

    return pool
