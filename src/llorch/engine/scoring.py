"""Prompt scoring: the log-probability of each prompt token given the tokens before it.

Evaluations (multiple-choice loglikelihood) read these. The logits of a chunk's
scored rows are reduced on the device to each row's chosen-token log-probability and
its top-k alternatives; only those leave it, in one transfer, and the logits are
dropped with the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def score_rows(logits: Tensor, targets: list[int], top: int) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Per row of `logits` [R, vocab]: log-softmax at `targets[r]`, and the `top` best (id, log-probability)."""
    rows = logits.shape[0]
    if rows == 0:
        return []
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


Pool = Callable[[Tensor], tuple[float, ...]]  # a pooled job's output from its prompt's last row


def rank_pool(tokens: tuple[int, int]) -> Pool:
    """A decoder reranker's relevance: the probability of its "yes" token against its "no" (`tokens`: no, yes)
    at the prompt's last position, as Qwen3-Reranker scores."""
    return lambda logits: (float(torch.softmax(logits[list(tokens)].float(), dim=-1)[1]),)


def last_token_pool(normalize: bool) -> Pool:
    """A decoder embedding model's vector: the last prompt token's final hidden state (Qwen3-Embedding's)."""
    def pool(hidden: Tensor) -> tuple[float, ...]:
        vector = hidden.float()
        return tuple((torch.nn.functional.normalize(vector, dim=-1) if normalize else vector).tolist())

    return pool
