"""Our Gemma 3 on the default GGUF computes what Hugging Face transformers computes.

Both sides dequantize the same Q4_K_M file to float32, so the only differences are
float32 summation order (ours: SDPA and fused matmuls; theirs: eager ops). Over 18
layers that stays far below 1e-2 in logits whose spread is tens of units, and a
greedy argmax that flips on such noise would be a near-tie, which the greedy test
would reveal as a mismatch.
"""

from __future__ import annotations

import pytest
import torch

from conftest import Reference, all_logits, greedy_ids
from llorch.weights.loader import LoadedModel

pytestmark = [pytest.mark.cpu, pytest.mark.reference]

LOGIT_ATOL = 2e-2
PROMPTS = [
    "The capital of France is",
    "Écris une courte phrase sur la mer. 海はとても広い。",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]


def reference_logits(reference: Reference, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference.model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(ours: LoadedModel, reference: Reference, prompt: str) -> None:
    ids = ours.tokenizer.encode(prompt)
    assert ids == reference.tokenizer(prompt).input_ids
    mine, theirs = all_logits(ours, ids), reference_logits(reference, ids)
    assert mine.shape == theirs.shape == (len(ids), ours.config.vocab_size)
    assert (mine - theirs).abs().max().item() < LOGIT_ATOL
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))


def test_logits_match_beyond_the_sliding_window(ours: LoadedModel, reference: Reference) -> None:
    """A prompt longer than the 512-token window exercises the sliding-attention mask."""
    text = " ".join(f"item {i} is {i * 7 % 13}." for i in range(200))
    ids = ours.tokenizer.encode(text)
    assert len(ids) > ours.config.sliding_window + 100
    mine, theirs = all_logits(ours, ids), reference_logits(reference, ids)
    assert (mine - theirs).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize("prompt", PROMPTS)
def test_first_32_greedy_tokens_match_transformers(ours: LoadedModel, reference: Reference, prompt: str) -> None:
    ids = ours.tokenizer.encode(prompt)
    generated = greedy_ids(ours, ids, 32, stop_at_eos=False)
    with torch.inference_mode():
        expected = reference.model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    expected = expected[0, len(ids):].tolist()
    assert generated[: len(expected)] == expected
    if len(expected) < 32:  # the reference stopped at an end-of-generation token: so must we
        assert generated[len(expected)] in ours.tokenizer.eos_token_ids
