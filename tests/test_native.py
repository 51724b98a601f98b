"""The C decoder step (models/native.py, kernels/csrc/decoder.c) against the torch decoder.

The torch path can run the same GGUF-typed layers (their forward calls the same block
kernels), so the two differ only in how norms, RoPE, attention and activations are
computed: float rounding. With float matrices that is checked tightly for every
architecture; with block matrices the activations are rounded to int8, which can carry a
float difference across a rounding boundary, so the bound is looser (the integer
arithmetic itself is proven exact in test_kernels.py, and the C step's batch invariance
bit-exactly below). The accuracy of the block types is test_quantized.py's subject.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import LLAMA_CPP_KL, all_logits, exported, greedy_ids
from hostile_files import Tensor, tiny_gemma3_parts
from llorch.engine.factory import kv_dtype
from llorch.engine.kv.pool import BLOCK_SIZE, HOST_KV_DTYPE, bytes_per_block
from llorch.engine.runner import ChunkInput, ModelRunner
from llorch.kernels import build
from llorch.models.decoder import Decoder
from llorch.weights.loader import LoadedModel, load_model
from llorch.weights.native_loader import load_native
from model_zoo import ARCHITECTURES, Q
from tiny_model import tiny_vocab

pytestmark = pytest.mark.cpu

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find"


@contextmanager
def torch_path(model: Decoder) -> Iterator[None]:
    """Run `model` through torch ops for a while (its GGUF-typed layers still use the block kernels)."""
    native, model.native = model.native, None
    try:
        yield
    finally:
        model.native = native


def load_blocks(path: Path) -> LoadedModel:
    loaded = load_model(path, torch.device("cpu"), torch.float32, keep_quantized=True)
    assert loaded.model.native is not None, "GGUF weights on the CPU in float32 run the C step"
    return loaded


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_loader_without_torch_gives_the_c_step_the_torch_loader_s_weights(zoo: dict[str, Path], arch: str,
                                                                              qtype: Q) -> None:
    """What the CPU worker loads (no torch) is, to the bit, what the torch decoder's C step reads."""
    path = exported(zoo, arch, qtype)
    ours, theirs = load_native(path).native, load_blocks(path).native
    assert ours is not None and theirs is not None
    assert ours.types == theirs.types
    assert sorted(ours.weights) == sorted(theirs.weights)
    for name, array in theirs.weights.items():
        assert ours.weights[name].dtype == array.dtype, name
        assert np.array_equal(ours.weights[name], array), name


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_c_step_computes_what_the_torch_decoder_computes(zoo: dict[str, Path], arch: str, qtype: Q) -> None:
    """Float matrices: no activation is rounded, and both paths keep keys and values as float16
    (the C step's cache). They differ by float rounding, which now and then moves a key or value
    to the neighbouring float16 (a 2^-11 relative step): measured on these models at most 5.5e-5
    relative RMS, bounded here at 1.5e-4."""
    loaded = load_blocks(exported(zoo, arch, qtype))
    ids = loaded.tokenizer.encode(PROMPT)
    native = all_logits(loaded, ids)
    with torch_path(loaded.model):
        reference = all_logits(loaded, ids, kv_dtype=torch.float16)
    assert float((native - reference).norm() / reference.norm()) < 1.5e-4
    assert torch.equal(native.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_with_block_matrices_the_paths_differ_by_activation_rounding_at_most(zoo: dict[str, Path], arch: str,
                                                                            qtype: Q) -> None:
    """Block matrices: both paths quantize each activation block to int8 with the same kernel, but
    their norms and attention round differently (about 1e-7), which now and then moves an
    activation across a rounding boundary: one int8 step, 1/254 of its block's largest
    value, which later layers carry on. Measured on these models: at most 1.1% relative
    RMS at a position. Bounded here at 3%, with the same top token at 90% of positions."""
    loaded = load_blocks(exported(zoo, arch, qtype))
    ids = loaded.tokenizer.encode(PROMPT)
    native = all_logits(loaded, ids)
    with torch_path(loaded.model):
        reference = all_logits(loaded, ids, kv_dtype=torch.float16)
    assert float((native - reference).norm() / reference.norm()) < 0.03
    assert float((native.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.9


def test_decoding_token_by_token_gives_the_bits_of_one_prompt_pass(served: LoadedModel) -> None:
    """Every row is computed on its own: position p's logits do not depend on how the rows were stepped."""
    ids = served.tokenizer.encode(PROMPT)
    sequence = ids + greedy_ids(served, ids, 24, stop_at_eos=False)
    at_once = all_logits(served, sequence)
    stepped = all_logits_stepped(served, sequence)
    assert torch.equal(at_once, stepped)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_decodes_alone_to_the_bits_of_one_prompt_pass(zoo: dict[str, Path], arch: str) -> None:
    """A lone decoding row runs the step's own path (each thread its copy of the residual stream; at short
    context, each thread its kv heads from RoPE to the softmax, in one phase): every architecture's biases,
    norms, sliding windows and grouped heads give, row by row, the bits of the general path, before and
    past the context where attention splits into chunks of keys (ATTN_CHUNK, 128)."""
    loaded = load_blocks(exported(zoo, arch, Q.Q8_0))
    ids = [(7 * i + 3) % 200 + 10 for i in range(140)]
    assert torch.equal(all_logits(loaded, ids), all_logits_stepped(loaded, ids))


def test_a_step_given_fewer_threads_than_it_asks_for_still_computes_every_kv_head(zoo: dict[str, Path]) -> None:
    """A thread limit (OMP_THREAD_LIMIT) can give the step fewer threads than it asks for: a lone row's kv heads
    are shared among the threads the step has, so none is left uncomputed."""
    script = "\n".join([
        f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1] / 'bench')!r}]",
        "from pathlib import Path",
        "import torch",
        "from conftest import all_logits",
        "from llorch.kernels import build",
        "from test_native import all_logits_stepped, load_blocks",
        "build.set_threads(2)",
        f"loaded = load_blocks(Path({str(exported(zoo, 'llama', Q.Q8_0))!r}))",
        "ids = [(7 * i + 3) % 200 + 10 for i in range(20)]",
        "print(torch.equal(all_logits(loaded, ids), all_logits_stepped(loaded, ids)))",
    ])
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "OMP_THREAD_LIMIT": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


def all_logits_stepped(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    from conftest import model_device, new_cache
    from llorch.models.step_batch import contiguous_step

    device, cache, rows = model_device(loaded), new_cache(loaded, len(ids)), []
    with torch.inference_mode():
        for position, token in enumerate(ids):
            step = contiguous_step(loaded.config, position, 1, device)
            rows.append(loaded.model(torch.tensor([token], device=device), step, cache))
    return torch.cat(rows).float()


@pytest.mark.parametrize("variant", [v.name for v in build.runnable_variants()])
def test_every_kernel_variant_is_as_faithful_to_the_exact_model(model_path: Path, ours: LoadedModel, variant: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The variants sum floats in different orders, and on a real model that moves some activations
    across int8 rounding boundaries (measured: up to 4% relative RMS between variants), so each
    is held to what matters: its KL divergence from the file computed exactly in float32,
    under the same bound as the main fidelity test (llama.cpp's KL on this file). The model is
    loaded under each variant, as a worker would: a variant may lay the matrices out its own way."""
    ids = ours.tokenizer.encode(PROMPT)
    ids = ids + greedy_ids(ours, ids, 40, stop_at_eos=False)
    exact = torch.log_softmax(all_logits(ours, ids).double(), -1)
    monkeypatch.setenv("LLORCH_KERNELS", variant)
    mine = torch.log_softmax(all_logits(load_blocks(model_path), ids).double(), -1)
    kl = float((exact.exp() * (exact - mine)).sum(-1).mean())
    assert kl <= LLAMA_CPP_KL, kl
    assert float((mine.argmax(-1) == exact.argmax(-1)).double().mean()) >= 0.9


def test_a_token_id_out_of_the_vocabulary_is_refused_not_read(served: LoadedModel) -> None:
    with pytest.raises(IndexError, match="out of range"):
        all_logits(served, [2, served.config.vocab_size])


@pytest.mark.parametrize("variant", [v.name for v in build.runnable_variants()])
def test_the_python_struct_mirrors_lay_out_exactly_as_the_c_library_does(variant: str) -> None:
    from llorch.kernels.step import C_LAYOUT_ORDER, c_layout, layout

    lib = build.load_variant(variant)
    for struct in C_LAYOUT_ORDER:
        assert layout(struct) == c_layout(lib, struct), f"{struct.__name__} differs between Python and C"


def test_an_allocation_the_c_step_cannot_make_fails_its_jobs_and_the_worker_goes_on(served: LoadedModel) -> None:
    from jobs import make_engine, run

    lib = build.library()
    engine = make_engine(served)
    try:
        baseline = run(engine, "before")
        assert baseline.wait()["type"] == "end"
        lib.llorch_fail_allocations(1)  # the step's next buffer is refused, as an exhausted machine would
        failed = run(engine, "starved")
        ending = failed.wait()
        assert ending["type"] == "error" and ending["code"] == "INFERENCE_FAILED"
        assert "could not allocate" in ending["message"] and len(failed.terminal_events) == 1
        after = run(engine, "after")
        assert after.wait()["type"] == "end" and after.text == baseline.text
        assert engine.alive and engine.stats().kv_blocks_used == 0
    finally:
        lib.llorch_fail_allocations(0)
        engine.stop()


def native_runner(loaded: LoadedModel, tokens: int) -> tuple[ModelRunner, list[int]]:
    """A runner over the C step with a KV pool for `tokens` positions, and every block of it."""
    pool = (tokens // BLOCK_SIZE + 3) * bytes_per_block(loaded.config, kv_dtype(loaded))
    runner = ModelRunner(loaded.native, None, HOST_KV_DTYPE, pool)
    return runner, list(range(1, runner.kv.num_blocks))


def test_the_step_s_own_argmax_is_the_logits_own(served: LoadedModel) -> None:
    """Greedy decoding takes each row's argmax from the C step, found while its threads were up: it is
    numpy's argmax of the very logits it returned, a prompt's rows and a batch's alike, and nothing is
    claimed for any other array (a selection of the rows, or a copy)."""
    ids = served.tokenizer.encode(PROMPT)
    runner, blocks = native_runner(served, 3 * len(ids) + 8)
    logits = runner.forward([ChunkInput(ids, 0, blocks, True, scored=range(len(ids) - 1))])
    assert runner.best_of(logits) == logits.argmax(-1).tolist()
    assert runner.best_of(logits[1:]) is None and runner.best_of(logits.copy()) is None
    # Three sequences decoding together, each in blocks of its own.
    width = len(blocks) // 3
    tables = [blocks[i * width : (i + 1) * width] for i in range(3)]
    for table in tables:
        runner.forward([ChunkInput(ids, 0, table, True)])
    for step in range(3):
        logits = runner.forward([ChunkInput([ids[step + i]], len(ids) + step, table, True)
                                 for i, table in enumerate(tables)])
        assert runner.best_of(logits) == logits.argmax(-1).tolist()


def test_a_lone_decoding_row_gives_the_bits_of_the_same_row_in_a_batch(served: LoadedModel) -> None:
    """A lone stream's decoding row takes a path of its own (NativeDecoder.decode_row, described once):
    its logits and argmax are, to the bit, those of the same row stepped beside another sequence on the
    general path, and logits a caller keeps are never overwritten by the next step."""
    ids = served.tokenizer.encode(PROMPT)
    runner, blocks = native_runner(served, 4 * len(ids) + 32)
    width = len(blocks) // 2
    alone, beside = blocks[:width], blocks[width:]
    runner.forward([ChunkInput(ids, 0, alone, True)])
    runner.forward([ChunkInput(ids, 0, beside, True)])
    kept, kept_values = None, None
    token = ids[-1]
    for step in range(6):
        position = len(ids) + step
        lone = runner.forward([ChunkInput([token], position, alone, True)])
        best = runner.best_of(lone)
        assert best == lone.argmax(-1).tolist()
        if kept is None:
            kept, kept_values = lone, lone.copy()
        # the same row again (its key and value rewritten as they were), second in a batch of two
        batch = runner.forward([ChunkInput([ids[step]], position, beside, True),
                                ChunkInput([token], position, alone, True)])
        assert np.array_equal(batch[1], lone[0]) and runner.best_of(batch)[1] == best[0]
        token = best[0]
    assert np.array_equal(kept, kept_values)
    # logits no caller keeps are written again in place: a fresh megabyte a step cost page faults
    del kept, lone, batch
    at = runner.forward([ChunkInput([token], len(ids) + 6, alone, True)]).ctypes.data
    assert runner.forward([ChunkInput([token], len(ids) + 6, alone, True)]).ctypes.data == at


def test_decoding_rows_get_the_same_bits_whichever_thread_takes_each_chunk(served: LoadedModel) -> None:
    """A decoding product's chunks are each thread's fixed share, but a thread done with its own takes chunks off
    the end of another's, from the pass that one is in (matmul.c's decode_chunks). With more threads than cores
    the host runs them very unevenly, so chunks are taken, a lone row's and a batch's, in products of one pass
    and of several: every logit is still, to the bit, the one-thread step's."""
    lib = build.library()
    ids = served.tokenizer.encode(PROMPT)
    threads = build.threads()

    def decode(count: int) -> list[np.ndarray]:
        build.set_threads(count)
        runner, blocks = native_runner(served, 4 * len(ids) + 32)
        width = len(blocks) // 2
        first, second = blocks[:width], blocks[width:]
        runner.forward([ChunkInput(ids, 0, first, True)])
        runner.forward([ChunkInput(ids, 0, second, True)])
        out = []
        for step in range(6):
            position = len(ids) + step
            out.append(runner.forward([ChunkInput([ids[step]], position, first, True)]).copy())
            out.append(runner.forward([ChunkInput([ids[step]], position, first, True),
                                       ChunkInput([ids[-step]], position, second, True)]).copy())
        return out

    try:
        alone = decode(1)
        lib.llorch_take_chunks_taken()
        crowded = decode(6)
        taken = lib.llorch_take_chunks_taken()
    finally:
        build.set_threads(threads)
    assert taken > 0, "six threads on this machine's cores took no chunk off another's share"
    assert all(np.array_equal(a, b) for a, b in zip(alone, crowded, strict=True))


@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["found by the product", "found after the soft cap"])
def test_the_step_s_argmax_takes_the_first_of_equal_logits_and_leaves_nan_rows_to_the_array(
        tmp_path: Path, softcap: float) -> None:
    """Every output row alike: every logit of a row is equal, across the threads' shares of the
    vocabulary, and the first index is the answer, as numpy's and torch's argmax give. One token's
    embedding at 3e38 makes the rows from it on NaN: the step claims no argmax then. Alike whether the
    vocabulary projection finds the argmax as it writes the logits, or (a model whose logits are soft
    capped after it) the step reads them after."""
    parts = tiny_gemma3_parts(tmp_path)
    embedding = parts.tensor("token_embd.weight")
    rows = np.frombuffer(embedding.data, dtype=np.float32).reshape(embedding.shape).copy()
    parts.tensors.append(Tensor("output.weight", embedding.shape, embedding.ggml_type,
                                np.repeat(rows[270:271], len(rows), axis=0).tobytes()))
    poisoned = tiny_vocab()[0].index("<0x7E>")
    rows[poisoned] = 3e38
    embedding.data = rows.tobytes()
    loaded = load_native(parts.write(tmp_path / "uniform-head.gguf"))
    loaded.native.model.logit_softcap = softcap
    runner, blocks = native_runner(loaded, 32)
    logits = runner.forward([ChunkInput([2, 270, 271, 272], 0, blocks, True, scored=range(3))])
    assert np.all(logits == logits[:, :1]) and runner.best_of(logits) == [0, 0, 0, 0]
    logits = runner.forward([ChunkInput([2, 270, poisoned, 271], 0, blocks, True, scored=range(3))])
    assert np.isnan(logits[2]).any() and runner.best_of(logits) is None
