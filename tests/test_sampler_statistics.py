"""Each sampler stage, checked statistically over thousands of seeded draws.

Every test uses a fixed generator seed, so the draws (and the p-values) are the same
on every run: these tests cannot flake, and a wrong distribution fails them.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from llorch.engine.penalties import apply_presence_frequency, apply_repetition_penalty
from llorch.engine.request import SamplingParams
from llorch.engine.sampler import SamplerState, filtered_probs, sample_batch

pytestmark = pytest.mark.cpu

DRAWS = 6000
LOGITS = torch.tensor([2.0, 1.6, 1.5, 1.1, 0.7, 0.2, -0.3, -0.9, -1.4, -2.5])
SEED = 20261122


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, prompt: list[int] | None = None,
         counts: torch.Tensor | None = None) -> Counter[int]:
    """DRAWS tokens from one sequence's sampler (its history frozen), in batches of 100 rows.

    Each row of a batch is the same sequence state, so a batch gives 100 draws from the
    sequence's own random stream, as 100 consecutive steps would.
    """
    state = SamplerState(params, SEED, prompt or [], len(logits), torch.device("cpu"))
    if counts is not None:
        assert state.counts is not None
        state.counts += counts
    batch = logits.expand(100, -1)
    return Counter(s.token_id for _ in range(DRAWS // 100) for s in sample_batch(batch, [state] * 100))


def assert_follows(counts: Counter[int], probs: torch.Tensor) -> None:
    """Draws land only where probs > 0, and their frequencies pass a chi-square test against probs."""
    support = [i for i, p in enumerate(probs.tolist()) if p > 0]
    assert set(counts) <= set(support)
    if len(support) == 1:
        assert counts[support[0]] == DRAWS
        return
    observed = [counts.get(i, 0) for i in support]
    mass = sum(float(probs[i]) for i in support)
    expected = [float(probs[i]) / mass * DRAWS for i in support]
    assert chisquare(observed, expected).pvalue > 1e-3


def test_temperature_scales_the_softmax() -> None:
    for temperature in (0.5, 1.0, 1.7):
        counts = draw(SamplingParams(temperature=temperature))
        assert_follows(counts, torch.softmax(LOGITS / temperature, -1))


def test_temperature_distribution_is_not_the_unscaled_one() -> None:
    counts = draw(SamplingParams(temperature=0.5))
    observed = [counts.get(i, 0) for i in range(len(LOGITS))]
    expected = (torch.softmax(LOGITS.double(), -1) * DRAWS).tolist()
    assert chisquare(observed, expected).pvalue < 1e-6  # the test above has power


def test_top_k_never_leaves_the_top_k() -> None:
    counts = draw(SamplingParams(temperature=1.0, top_k=3))
    assert set(counts) == {0, 1, 2}
    kept = torch.softmax(LOGITS[:3], -1)
    assert_follows(counts, torch.cat([kept, torch.zeros(len(LOGITS) - 3)]))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.softmax(LOGITS, -1)
    cumulative = torch.cumsum(probs, -1)  # LOGITS is sorted, so this is the sorted cumsum
    for top_p in (0.3, 0.75, 0.95):
        size = int((cumulative < top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
        counts = draw(SamplingParams(temperature=1.0, top_p=top_p))
        assert set(counts) == set(range(size))
        kept = torch.cat([probs[:size] / probs[:size].sum(), torch.zeros(len(LOGITS) - size)])
        assert_follows(counts, kept)


def test_min_p_drops_tokens_below_its_share_of_the_top() -> None:
    probs = torch.softmax(LOGITS, -1)
    min_p = 0.3
    keep = probs >= min_p * probs.max()
    counts = draw(SamplingParams(temperature=1.0, min_p=min_p))
    assert set(counts) == set(torch.nonzero(keep).flatten().tolist())
    assert_follows(counts, torch.where(keep, probs, 0.0) / probs[keep].sum())


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    seen = [0, 0, 9]
    penalized = apply_repetition_penalty(LOGITS, torch.tensor(seen), 1.5)
    assert penalized[0] == pytest.approx(2.0 / 1.5)
    assert penalized[9] == pytest.approx(-2.5 * 1.5)
    assert torch.equal(penalized[1:9], LOGITS[1:9])
    assert_follows(draw(SamplingParams(temperature=1.0, repetition_penalty=1.5), prompt=seen),
                   torch.softmax(penalized, -1))


def test_stages_apply_in_order_penalty_temperature_top_k_top_p_min_p() -> None:
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    seen = torch.tensor([1])
    logits = apply_repetition_penalty(LOGITS, seen, 1.3) / 0.8
    top6 = torch.topk(logits, 6).indices
    masked = torch.full_like(logits, float("-inf"))
    masked[top6] = logits[top6]
    probs = torch.softmax(masked, -1)
    order = torch.argsort(probs, descending=True)
    before = torch.cumsum(probs[order], -1) - probs[order]
    probs[order[before >= 0.9]] = 0.0
    probs[probs < 0.05 * probs.max()] = 0.0
    expected = probs / probs.sum()
    got = filtered_probs(apply_repetition_penalty(LOGITS, seen, 1.3), params)
    assert torch.allclose(got, expected, atol=1e-6)
    assert_follows(draw(params, prompt=[1]), expected)


def test_greedy_ignores_the_generator() -> None:
    counts = draw(SamplingParams(temperature=0.0))
    assert counts == Counter({0: DRAWS})


def test_presence_and_frequency_penalties_follow_openai() -> None:
    counts = torch.zeros(len(LOGITS))
    counts[0], counts[3] = 3, 1
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    penalized = apply_presence_frequency(LOGITS, counts, params)
    assert penalized[0] == pytest.approx(2.0 - 0.5 - 3 * 0.25)
    assert penalized[3] == pytest.approx(1.1 - 0.5 - 0.25)
    untouched = [i for i in range(len(LOGITS)) if i not in (0, 3)]
    assert torch.equal(penalized[untouched], LOGITS[untouched])
    assert_follows(draw(params, counts=counts), torch.softmax(penalized, -1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((9, 3.0),))])
def test_numpy_rows_draw_what_torch_rows_draw(params: SamplingParams) -> None:
    """The C step's logits come as numpy arrays, with the sampler's history in numpy (no device): every one of
    the seeded draws is the torch row's, so the distributions above hold for them too."""
    host = SamplerState(params, SEED, [1], len(LOGITS), None)
    device = SamplerState(params, SEED, [1], len(LOGITS), torch.device("cpu"))
    for token in (0, 0, 0, 3):  # history for the penalties that read it
        host.accept(token)
        device.accept(token)
    batch = LOGITS.expand(100, -1).contiguous()
    drawn: Counter[int] = Counter()
    for _ in range(DRAWS // 100):
        ours = [s.token_id for s in sample_batch(batch.numpy(), [host] * 100)]
        assert ours == [s.token_id for s in sample_batch(batch, [device] * 100)]
        drawn.update(ours)
    assert len(drawn) > 3  # sampled, not one token over and over
