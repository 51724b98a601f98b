"""The per-row work on numpy logits, as the CPU worker's C step hands them over, equals the torch path's.

Same logits, same seed: the same tokens, the same masks bit for bit, the same prompt-scoring
ranks, and log-probabilities within float32 rounding (LOGPROB below: torch sums the
softmax's denominator in float32, numpy here in float64). And none of the modules that do
this work imports torch: only loading the C kernels does (llorch.kernels.build), on purpose.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from llorch.engine import host_rows
from llorch.engine.masks import GrammarMasks, mask_proposals
from llorch.engine.penalties import penalized
from llorch.engine.request import SamplingParams
from llorch.engine.sampler import Sampled, SamplerState, argmax, draw, filtered_probs, sample_batch
from llorch.engine.scoring import last_token_pool, rank_pool, score_rows
from llorch.engine.verify import verify
from llorch.kernels.rows import argmax_rows, mask_rows, sample_row

pytestmark = pytest.mark.cpu

VOCAB = 262_144
# numpy's log-probabilities against torch's. torch sums the denominator's 262,144 float32 terms in lanes as wide
# as the CPU's vectors, so its error depends on the CPU: under 2e-5 with AVX-512, 3.0e-5 seen with AVX2 alone.
LOGPROB = {"rel": 1e-6, "abs": 1e-4}
NAN, INF = float("nan"), float("inf")
CPU = torch.device("cpu")
FINITE = ("normal", "peaked", "flat", "masked")
NON_FINITE = ("nan", "inf", "all -inf", "mixed")


def kinds(width: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One float32 row of each kind the engine meets: ordinary, one token far ahead, all equal, mostly masked
    by a grammar, and the non-finite ones a broken model makes."""
    rng = np.random.default_rng(seed)
    normal = (rng.standard_normal(width) * 3).astype(np.float32)
    rows = {"normal": normal, "peaked": normal.copy(), "flat": np.zeros(width, np.float32),
            "masked": np.full(width, -np.inf, np.float32), "nan": normal.copy(), "inf": normal.copy(),
            "all -inf": np.full(width, -np.inf, np.float32), "mixed": normal.copy()}
    rows["peaked"][width // 3] = 40.0
    allowed = rng.choice(width, 5, replace=False)
    rows["masked"][allowed] = normal[allowed]
    rows["nan"][[width // 2, width // 5]] = np.nan
    rows["inf"][[width // 2, width // 5]] = np.inf
    rows["mixed"][[1, 2, 3]] = [-np.inf, np.inf, np.nan]
    return rows


def matrix(names: tuple[str, ...], width: int = VOCAB, seed: int = 0) -> np.ndarray:
    rows = kinds(width, seed)
    return np.stack([rows[name] for name in names])


def as_torch(logits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(logits.copy())  # its own memory: masks and penalties must not reach the other copy


def states(params: list[SamplingParams], device: torch.device | None, prompt: tuple[int, ...] = (5, 9, 5, 7),
           eos: tuple[int, ...] = (2, 11), vocab: int = VOCAB) -> list[SamplerState]:
    return [SamplerState(p, 1000 + i, list(prompt), vocab, device, eos) for i, p in enumerate(params)]


def assert_same_sampled(ours: list[Sampled], theirs: list[Sampled], ties: bool = False) -> None:
    """Same tokens; log-probabilities equal to LOGPROB (NaN where torch's is NaN); the same top ids in the same
    order unless the row has ties, whose order torch leaves to its own selection."""
    assert [s.token_id for s in ours] == [s.token_id for s in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert (a.logprob is None) == (b.logprob is None)
        if a.logprob is None:
            continue
        values_a = [a.logprob] + [v for _, v in a.top]
        values_b = [b.logprob] + [v for _, v in b.top]
        assert np.isnan(values_a).tolist() == np.isnan(values_b).tolist()
        finite = [(x, y) for x, y in zip(values_a, values_b, strict=True) if not np.isnan(y)]
        assert [x for x, _ in finite] == pytest.approx([y for _, y in finite], **LOGPROB)
        if not ties and not np.isnan(b.logprob):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


# kernels.rows


def test_argmax_rows_on_numpy_is_torch_argmax_for_every_kind_of_row() -> None:
    logits = matrix(FINITE + NON_FINITE)
    expected = [int(torch.argmax(row)) for row in as_torch(logits)]
    assert argmax_rows(logits) == argmax_rows(as_torch(logits)) == expected
    assert argmax(logits).tolist() == expected
    assert expected[FINITE.index("peaked")] == VOCAB // 3 and expected[FINITE.index("flat")] == 0


def test_a_row_holding_nan_argmaxes_to_its_first_nan_as_torch_does() -> None:
    row = np.array([[1.0, 8.0, NAN, 9.0, NAN, INF]], np.float32)
    assert int(torch.argmax(torch.from_numpy(row))) == 2  # what the numpy path mirrors
    assert argmax_rows(row) == [2]
    wide = matrix(("normal",))
    wide[0, [200_000, 100_000]] = np.nan
    wide[0, 5] = 1e30
    assert argmax_rows(wide) == argmax_rows(as_torch(wide)) == [100_000]


@pytest.mark.parametrize("setting", [(1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0), (1.3, 0, 0.9, 0.0),
                                     (1.0, 0, 1.0, 0.05), (0.8, 50, 0.95, 0.02), (1e-6, 0, 1.0, 0.0)])
def test_sample_row_on_numpy_draws_the_torch_row_s_token(setting: tuple[float, int, float, float]) -> None:
    rows = kinds(VOCAB)
    for name in FINITE:
        tokens = [(sample_row(rows[name], *setting, u), sample_row(torch.from_numpy(rows[name]), *setting, u))
                  for u in np.linspace(0.0, 0.999, 9)]
        assert all(a == b and a is not None for a, b in tokens), name
    for name in NON_FINITE:
        assert sample_row(rows[name], *setting, 0.5) is None
        assert sample_row(torch.from_numpy(rows[name]), *setting, 0.5) is None


def random_bitmask(rows: int, words: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bitmask = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    bitmask[:, ::3] = -1  # every token of the word allowed: the C loop's shortcut
    bitmask[:, 1::7] = 0
    return bitmask


def test_mask_rows_on_numpy_masks_the_same_bits_as_on_torch() -> None:
    logits = matrix(("normal", "peaked", "flat", "nan"))
    rows = [0, 2, 3]
    for words in (VOCAB // 32, VOCAB // 32 - 5):  # a short mask disallows the ids past it
        bitmask = random_bitmask(len(rows), words, words)
        ours, theirs = logits.copy(), as_torch(logits)
        mask_rows(ours, rows, bitmask)
        mask_rows(theirs, rows, torch.from_numpy(bitmask))
        assert ours.tobytes() == theirs.numpy().tobytes()
        allowed = ((bitmask[..., None] >> np.arange(32)) & 1).astype(bool).reshape(len(rows), -1)
        masked = np.isneginf(ours[rows]) & ~np.isneginf(logits[rows])
        assert (masked[:, : allowed.shape[1]] == ~allowed).all() and masked[:, allowed.shape[1] :].all()
        assert ours[1].tobytes() == logits[1].tobytes()  # a row not named is untouched
        # float64 logits take the unpacking path (numpy's, torch's): the same tokens masked, a torch mask too
        wide, wide_torch = logits.astype(np.float64), torch.from_numpy(logits.astype(np.float64))
        mask_rows(wide, rows, torch.from_numpy(bitmask))
        mask_rows(wide_torch, rows, bitmask)
        assert wide.astype(np.float32).tobytes() == ours.tobytes() == wide_torch.float().numpy().tobytes()


# engine.masks


class _Bytes:
    """A vocabulary of the 256 bytes, an end token and padding up to VOCAB, as llguidance reads one."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"] + [b"<pad%d>" % i for i in range(VOCAB - 257)]
        self.eos_token_id, self.bos_token_id, self.special_token_ids = 256, None, [256]

    def __call__(self, text: str) -> list[int]:
        return list(text.encode())


@pytest.fixture(scope="module")
def matcher() -> LLMatcher:
    tokenizer = LLTokenizer(TokenizerWrapper(_Bytes()), n_vocab=VOCAB, eos_token=[256])
    return LLMatcher(tokenizer, LLMatcher.grammar_from_regex("(cuda|cpu)!"), log_level=0)


def test_grammar_masks_on_numpy_logits_allow_only_the_grammar_s_tokens(matcher: LLMatcher) -> None:
    masks = GrammarMasks(VOCAB)
    sampling = [SimpleNamespace(job_id="free", matcher=None), SimpleNamespace(job_id="constrained", matcher=matcher)]
    logits = matrix(("normal", "flat", "normal"))
    ours, theirs = logits.copy(), as_torch(logits)
    masks.begin(sampling).apply(sampling, ours, [0, 2])  # type: ignore[arg-type]
    masks.begin(sampling).apply(sampling, theirs, [0, 2])  # type: ignore[arg-type]
    assert ours.tobytes() == theirs.numpy().tobytes()
    assert ours[:2].tobytes() == logits[:2].tobytes()
    assert np.flatnonzero(np.isfinite(ours[2])).tolist() == [ord("c")]
    greedy = states([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)], None, (), ())
    assert [s.token_id for s in sample_batch(ours[[2, 2]], greedy)] == [ord("c")] * 2


def test_proposal_rows_on_numpy_are_masked_by_the_grammar_after_the_proposals(matcher: LLMatcher) -> None:
    logits = matrix(("normal", "normal", "normal"))
    ours, theirs = logits.copy(), as_torch(logits)
    draft = [ord("c"), ord("u"), ord("x")]  # "x" breaks the grammar: its row stays as it was
    mask_proposals(matcher, draft, ours, VOCAB // 32)
    mask_proposals(matcher, draft, theirs, VOCAB // 32)
    assert ours.tobytes() == theirs.numpy().tobytes()
    assert [np.flatnonzero(np.isfinite(row)).tolist() for row in ours[:2]] == [[ord("p"), ord("u")], [ord("d")]]
    assert ours[2].tobytes() == logits[2].tobytes()


# engine.sampler


def every_setting() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.0, repetition_penalty=1.4),
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.7, top_k=40),
            SamplingParams(temperature=1.2, top_p=0.9),
            SamplingParams(temperature=0.9, min_p=0.05),
            SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, repetition_penalty=1.3),
            SamplingParams(temperature=1.0, presence_penalty=0.6, frequency_penalty=0.4),
            SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=1.0),
            SamplingParams(temperature=1.0, logit_bias=((3, 5.0), (17, -100.0), (99, 2.5))),
            SamplingParams(temperature=0.0, logit_bias=((3, 50.0),)),
            SamplingParams(temperature=0.6, min_tokens=3),
            SamplingParams(temperature=0.0, min_tokens=2, repetition_penalty=0.8)]


def test_penalized_rows_are_the_same_bits_on_numpy_as_on_torch() -> None:
    """Bias, repetition penalty over a history with repeated ids (grown past its first buffer), presence and
    frequency penalties and min_tokens' masked end ids: the same float32 operations, the same bits."""
    params = every_setting()
    ours, theirs = states(params, None), states(params, CPU)
    logits = kinds(VOCAB)["normal"]
    for step in range(80):
        for state in ours + theirs:
            state.accept([5, 7, 5, 300, 2][step % 5])
        if step % 20 == 0 or step < 3:
            for a, b in zip(ours, theirs, strict=True):
                assert penalized(logits, a).tobytes() == penalized(torch.from_numpy(logits), b).numpy().tobytes()


def test_sample_batch_on_numpy_chooses_the_torch_path_s_tokens_with_its_logprobs() -> None:
    params = every_setting()
    ours, theirs = states(params, None), states(params, CPU)
    wanted = [None, 3, 0, 5, None, 1, 20, None, 2, 4, None, 3, 1]
    chosen = []
    for step in range(6):
        logits = np.stack([kinds(VOCAB, seed=step * 100 + i)["normal"] for i in range(len(params))])
        logits[3, 40] += 12.0  # some rows peaked
        logits[11:, 2] += 60.0  # the min_tokens rows' end token: certain once allowed
        sampled = sample_batch(logits, ours, wanted)
        assert_same_sampled(sampled, sample_batch(as_torch(logits), theirs, wanted))
        for state, s in zip(ours + theirs, sampled + sampled, strict=True):
            state.accept(s.token_id)
        chosen.append([s.token_id for s in sampled[11:]])
    ended = [[token == 2 for token in row] for row in chosen]  # min_tokens=3 and 2: the end token from then on
    assert ended == [[False, False], [False, False], [False, True], [True, True], [True, True], [True, True]]


def test_sampled_rows_of_a_step_draw_the_tokens_each_draws_alone() -> None:
    """A step's sampled rows go to C together, shared by the step's threads: each row's token is the one it
    draws alone (its own stream, its own settings), a NaN row's and the rows beside a greedy or penalized one too."""
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.3, top_k=40), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.05),
              SamplingParams(temperature=0.8, repetition_penalty=1.3), SamplingParams(temperature=2.0, top_p=0.99),
              SamplingParams(temperature=1.0)]
    names = ("normal", "normal", "peaked", "normal", "flat", "normal", "normal", "nan")
    together, alone = states(params, None), states(params, None)
    for step in range(3):
        logits = np.stack([kinds(VOCAB, seed=10 * step + i)[name] for i, name in enumerate(names)])
        batch = [s.token_id for s in sample_batch(logits, together)]
        single = [sample_batch(logits[i : i + 1], [alone[i]])[0].token_id for i in range(len(params))]
        assert batch == single
        assert batch[-1] == VOCAB - 1  # the NaN row: searchsorted's last id, as a row alone
        for state, other, token in zip(together, alone, batch, strict=True):
            state.accept(token)
            other.accept(token)


def test_plain_greedy_rows_on_numpy_are_their_argmax_in_one_pass() -> None:
    logits = matrix(("normal", "peaked", "flat", "masked", "nan", "inf"))
    greedy = [SamplingParams(temperature=0.0)] * 6
    expected = [int(torch.argmax(row)) for row in as_torch(logits)]
    assert [s.token_id for s in sample_batch(logits, states(greedy, None))] == expected


@pytest.mark.parametrize("name", (*NON_FINITE, "flat", "masked"))
def test_non_finite_and_tied_rows_choose_as_on_torch(name: str) -> None:
    """NaN, +inf and all -inf rows: a sampled row's distribution is NaN there, and searchsorted (torch's, numpy's)
    then gives the last id; a greedy row takes the argmax; every log-probability is NaN. Rows of equal or masked
    logits: the same tokens and log-probabilities."""
    params = every_setting()
    logits = np.stack([kinds(VOCAB)[name]] * len(params))
    wanted = [4] * len(params)
    ours = sample_batch(logits, states(params, None), wanted)
    assert_same_sampled(ours, sample_batch(as_torch(logits), states(params, CPU), wanted), ties=True)
    if name in NON_FINITE:
        assert ours[2].token_id == VOCAB - 1 and np.isnan(ours[2].logprob)  # type: ignore[arg-type]


def test_top_alternatives_of_equal_logits_come_in_index_order() -> None:
    """torch.topk orders equal values by its own selection; the numpy path by index. Values agree."""
    logits = matrix(("flat", "masked"))
    ours = sample_batch(logits, states([SamplingParams(temperature=0.0)] * 2, None), [6, 8])
    assert [t for t, _ in ours[0].top] == list(range(6))
    allowed = np.flatnonzero(np.isfinite(logits[1]))
    by_logit = allowed[np.argsort(-logits[1][allowed])].tolist()
    assert [t for t, _ in ours[1].top] == by_logit + [i for i in range(8) if i not in by_logit][:3]
    assert [v for _, v in ours[1].top][5:] == [-INF] * 3


@pytest.mark.parametrize("setting", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3),
                                     SamplingParams(temperature=1.5, top_p=0.6),
                                     SamplingParams(temperature=1.0, top_k=6, top_p=0.8, min_p=0.1)])
def test_filtered_probs_and_draw_on_numpy_follow_torch(setting: SamplingParams) -> None:
    rows = kinds(12, seed=4)
    for name in FINITE if setting.top_p == 1.0 else ("normal", "peaked", "masked"):  # torch.sort orders ties its way
        ours = filtered_probs(rows[name], setting)
        theirs = filtered_probs(torch.from_numpy(rows[name]), setting)
        assert ours.dtype == np.float32 and np.allclose(ours, theirs.numpy(), rtol=1e-6, atol=1e-7), name
        for u in np.linspace(0.0, 0.999, 23):
            assert draw(ours, u) == int(draw(theirs, u)), (name, u)
    for name in NON_FINITE:
        ours = filtered_probs(rows[name], setting)
        assert np.isnan(ours).all() and np.isnan(filtered_probs(torch.from_numpy(rows[name]), setting).numpy()).all()
        assert draw(ours, 0.3) == int(draw(torch.from_numpy(ours), 0.3)) == 11


def test_top_ids_rank_nan_first_then_by_value_then_by_index() -> None:
    values = np.array([1.0, NAN, 3.0, 3.0, -INF, INF, NAN, 2.0], np.float32)
    assert host_rows.top_ids(values, 8).tolist() == [1, 6, 5, 2, 3, 7, 0, 4]
    assert host_rows.top_ids(values, 1).tolist() == [1] and host_rows.top_ids(values, 0).tolist() == []
    assert host_rows.top_ids(values[2:], 3).tolist() == [4, 3, 0]
    with pytest.raises(ValueError, match="top 9"):
        host_rows.top_ids(values, 9)
    random = kinds(VOCAB)["normal"]
    assert host_rows.top_ids(random, 20).tolist() == torch.topk(torch.from_numpy(random), 20).indices.tolist()


def test_verification_on_numpy_keeps_the_torch_path_s_tokens() -> None:
    logits = matrix(("normal", "peaked", "normal", "normal"), seed=8)
    draft = [int(logits[0].argmax()), VOCAB // 3, 17]  # greedy keeps two, then refuses the third
    for setting in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.2),
                    SamplingParams(temperature=0.9, top_k=5)):
        ours = verify(logits, draft, states([setting], None)[0], 2)
        assert_same_sampled(ours, verify(as_torch(logits), draft, states([setting], CPU)[0], 2))
        without = verify(logits, draft, states([setting], None)[0], None)
        assert [s.token_id for s in without] == [s.token_id for s in ours]
        if setting == SamplingParams(temperature=0.0):
            assert [s.token_id for s in ours] == [*draft[:2], int(logits[2].argmax())]


# engine.scoring


def test_score_rows_on_numpy_equal_torch_s() -> None:
    names = ("normal", "peaked", "masked", "normal", "nan", "inf", "all -inf")
    logits = matrix(names, seed=2)
    masked = np.flatnonzero(np.isfinite(logits[2]))
    targets = [7, VOCAB // 3, int(masked[0]), 8, 1, VOCAB // 2, 0]
    ours, theirs = score_rows(logits, targets, 5), score_rows(as_torch(logits), targets, 5)
    for name, (value, top), (torch_value, torch_top) in zip(names, ours, theirs, strict=True):
        values, torch_values = [value, *(v for _, v in top)], [torch_value, *(v for _, v in torch_top)]
        assert np.isnan(values).tolist() == np.isnan(torch_values).tolist(), name
        assert np.isinf(values).tolist() == np.isinf(torch_values).tolist(), name
        if name in FINITE:
            assert values == pytest.approx(torch_values, **LOGPROB)
            assert [i for i, _ in top] == [i for i, _ in torch_top]
    assert score_rows(logits[:0], [], 3) == []
    assert score_rows(logits[:1], [7], 0) == [(pytest.approx(theirs[0][0], **LOGPROB), ())]


def test_pools_on_numpy_equal_torch_s() -> None:
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal(5000) * 4).astype(np.float32)
    rank = rank_pool((17, 4000))
    assert rank(logits) == pytest.approx(rank(torch.from_numpy(logits)), rel=1e-6)
    hidden = rng.standard_normal(1024).astype(np.float16)
    for normalize in (True, False):
        pool = last_token_pool(normalize)
        assert pool(hidden) == pytest.approx(pool(torch.from_numpy(hidden)), rel=1e-5, abs=1e-7)
    assert last_token_pool(True)(np.zeros(8, np.float32)) == (0.0,) * 8  # no division by zero, as torch's


# imports


NUMPY_ONLY = r"""
import sys
import numpy as np

from llorch.engine import masks, sampler, scoring
from llorch.kernels import rows

assert "torch" not in sys.modules, "importing the row modules imported torch"
from llorch.engine.request import SamplingParams

logits = np.random.default_rng(0).standard_normal((3, 4096)).astype(np.float32) * 3
logits[1, 77] = 30.0
logits[2, 9] = 40.0
scored = scoring.score_rows(logits, [1, 2, 3], 4)
pooled = scoring.rank_pool((1, 2))(logits[0]) + scoring.last_token_pool(True)(logits[0])
probs = sampler.filtered_probs(logits[0], SamplingParams(temperature=0.8, top_k=20, top_p=0.9))
assert "torch" not in sys.modules, "scoring, pooling or filtering a numpy row imported torch"

reached = []  # who imports torch first: the stack at that moment


class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not reached:
            import traceback
            reached.extend(frame.filename for frame in traceback.extract_stack())


sys.meta_path.insert(0, Watch())
bitmask = np.zeros((1, 4096 // 32), np.int32)
bitmask[0, 0] = 0b1010  # only ids 1 and 3
rows.mask_rows(logits, [0], bitmask)
params = [SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.0, repetition_penalty=10.0, logit_bias=((5, 1.0),)),
          SamplingParams(temperature=0.9, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, min_tokens=2)]
states = [sampler.SamplerState(p, 7, [77, 77, 3], 4096, None, (9,)) for p in params]
first = sampler.sample_batch(logits, states, [2, None, 3])
shifted = logits[0] - logits[0].max()
expected = shifted - np.log(np.exp(shifted.astype(np.float64)).sum())
assert first[0].token_id == int(np.argmax(logits[0])) in (1, 3), first[0]
assert abs(first[0].logprob - expected[first[0].token_id]) < 1e-5 and first[0].top[0][0] == first[0].token_id
assert int(np.argmax(logits[1])) == 77 != first[1].token_id, first[1]  # the penalty takes the seen peak down
assert first[2].token_id != 9 and len(first[2].top) == 3  # the end token, far ahead, is held back by min_tokens
print(" ".join(f for f in reached if "/llorch/" in f))
"""


def test_the_row_modules_never_import_torch_and_work_on_numpy_alone() -> None:
    """In a fresh interpreter: importing the modules, scoring, pooling and filtering a numpy row import no torch;
    sampling may, but only where the C kernels are loaded (their build module links torch's OpenMP runtime first)."""
    result = subprocess.run([sys.executable, "-c", NUMPY_ONLY], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    chain = [path.rsplit("/llorch/", 1)[-1] for path in result.stdout.split()]  # llorch's frames, outermost first
    assert list(dict.fromkeys(chain)) in ([], ["kernels/rows.py", "kernels/build.py"]), chain  # the loader, if any
