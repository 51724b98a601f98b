"""Hostile model files cost nothing: each is refused by a real worker in one line, at once.

Every file here is a tiny valid GGUF (tests/tiny_model.py) or Hugging Face directory with one
thing made wrong, as an attacker or a careless conversion tool would: absurd counts that used
to allocate gigabytes (many of them in sparse files, which claim gigabytes at no cost on disk),
values of the wrong type, overlapping or repeated tensors, vocabularies built to make tokenizer
recovery explode, megabyte names, inconsistent sizes, and paths that are not regular files.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_failure, run_worker_to_exit
from hostile_files import (
    ARRAY,
    F32,
    F32_TENSOR,
    F64,
    I32,
    Q8_0_TENSOR,
    STRING,
    U8,
    U64,
    GGUFParts,
    SafeTensor,
    Tensor,
    Zeros,
    q8_0_bytes,
    tiny_gemma3_parts,
    tiny_llama_config,
    tiny_llama_tensors,
    tokenizer_json,
    write_safetensors,
    write_sparse,
    write_tiny_llama_dir,
)

pytestmark = pytest.mark.cpu

# A refusal reads the header and stops: far below the minutes these files used to take.
REFUSAL_SECONDS = 60


@pytest.fixture
def parts(tmp_path: Path) -> GGUFParts:
    return tiny_gemma3_parts(tmp_path)


def refused(path: Path, *fragments: str) -> None:
    started = time.monotonic()
    result = run_worker_to_exit("--model", str(path), timeout=REFUSAL_SECONDS)
    assert_one_line_failure(result, str(path), *fragments)
    assert time.monotonic() - started < REFUSAL_SECONDS


def test_the_pristine_parts_load(parts: GGUFParts, tmp_path: Path) -> None:
    """The writer itself is sound: written back unchanged, the tiny model loads (so each refusal
    below is caused by the one thing each test breaks)."""
    import torch

    from llorch.weights.loader import load_model

    loaded = load_model(parts.write(tmp_path / "same.gguf"), torch.device("cpu"), torch.float32)
    assert loaded.config.num_layers == 2


# -- absurd counts: refused before anything is sized by them -----------------------------------------

def test_block_count_of_two_to_the_forty(parts: GGUFParts, tmp_path: Path) -> None:
    path = parts.set("gemma3.block_count", U64, 2**40).write(tmp_path / "layers.gguf")
    refused(path, "gemma3.block_count", str(2**40), "between 1 and")


@pytest.mark.parametrize("key", ["embedding_length", "attention.head_count", "attention.head_count_kv",
                                 "feed_forward_length"])
def test_negative_sizes(parts: GGUFParts, tmp_path: Path, key: str) -> None:
    path = parts.set(f"gemma3.{key}", I32, -4).write(tmp_path / "negative.gguf")
    refused(path, f"gemma3.{key}", "-4", "between")


def test_context_length_zero_names_the_file_not_the_flag(parts: GGUFParts, tmp_path: Path) -> None:
    path = parts.set("gemma3.context_length", I32, 0).write(tmp_path / "context.gguf")
    result = run_worker_to_exit("--model", str(path), timeout=REFUSAL_SECONDS)
    assert_one_line_failure(result, "gemma3.context_length is 0")
    assert "--ctx-size" not in result.stderr


def test_negative_sliding_window(parts: GGUFParts, tmp_path: Path) -> None:
    path = parts.set("gemma3.attention.sliding_window", I32, -8).write(tmp_path / "window.gguf")
    refused(path, "sliding_window", "-8")


# -- values of the wrong type ---------------------------------------------------------------------

@pytest.mark.parametrize(("vtype", "value"), [
    (STRING, "32"), (F32, math.nan), (F64, math.inf), (ARRAY, (I32, [32, 32])),
], ids=["string", "nan", "infinity", "array"])
def test_alignment_that_is_not_an_integer(parts: GGUFParts, tmp_path: Path, vtype: int, value: object) -> None:
    path = parts.set("general.alignment", vtype, value).write(tmp_path / "alignment.gguf")
    refused(path, "general.alignment must be an integer")


def test_alignment_that_is_not_a_power_of_two(parts: GGUFParts, tmp_path: Path) -> None:
    path = parts.set("general.alignment", I32, 24).write(tmp_path / "alignment.gguf")
    refused(path, "general.alignment 24 is not a power of two")


def test_a_quantized_two_dimensional_norm(parts: GGUFParts, tmp_path: Path) -> None:
    norm = parts.tensor("blk.0.attn_norm.weight")
    norm.shape, norm.ggml_type = (1, 32), Q8_0_TENSOR
    norm.data = q8_0_bytes(np.ones(32, dtype=np.float32))
    path = parts.write(tmp_path / "norm.gguf")
    refused(path, "input_layernorm", "(1, 32)", "(32,)")


def test_a_name_that_is_not_text(parts: GGUFParts, tmp_path: Path) -> None:
    path = parts.set("general.name", I32, 7).write(tmp_path / "name.gguf")
    refused(path, "general.name must be a string")


# -- tensors that overlap, repeat or misalign -------------------------------------------------------

def test_every_tensor_pointing_at_one_blob(parts: GGUFParts, tmp_path: Path) -> None:
    for tensor in parts.tensors:
        tensor.offset = 0
    refused(parts.write(tmp_path / "overlap.gguf"), "overlap")


def test_a_duplicate_tensor_name(parts: GGUFParts, tmp_path: Path) -> None:
    """A second, smaller token_embd after the real one (which copy wins would be a guess)."""
    embed = parts.tensor("token_embd.weight")
    smaller = type(embed)(embed.name, (8, embed.shape[1]), embed.ggml_type, embed.data[: 8 * embed.shape[1] * 4])
    parts.tensors.append(smaller)
    refused(parts.write(tmp_path / "twice.gguf"), "tensor token_embd.weight appears twice")


def test_a_duplicate_metadata_key(parts: GGUFParts, tmp_path: Path) -> None:
    parts.metadata.append(("gemma3.block_count", U64, 1))
    refused(parts.write(tmp_path / "key.gguf"), "metadata key gemma3.block_count appears twice")


def test_a_misaligned_tensor_offset(parts: GGUFParts, tmp_path: Path) -> None:
    parts.tensors[-1].offset = sum(-(-len(t.data) // 32) * 32 for t in parts.tensors[:-1]) + 4
    refused(parts.write(tmp_path / "misaligned.gguf"), "not a multiple of the alignment 32")


# -- vocabularies and names built to amplify --------------------------------------------------------

def with_vocabulary(parts: GGUFParts, tokens: list[str]) -> GGUFParts:
    count = len(tokens)
    parts.set("tokenizer.ggml.tokens", ARRAY, (STRING, tokens))
    parts.set("tokenizer.ggml.scores", ARRAY, (F32, [0.0] * count))
    parts.set("tokenizer.ggml.token_type", ARRAY, (I32, [1] * count))
    return parts


def test_a_vocabulary_that_splits_every_way(parts: GGUFParts, tmp_path: Path) -> None:
    """"b", "bb", ... "b" x 1000: every cut of every token is a merge (a cubic number of characters)."""
    path = with_vocabulary(parts, ["b" * n for n in range(1, 1001)]).write(tmp_path / "splits.gguf")
    refused(path, "merges")


def test_a_token_of_a_million_characters(parts: GGUFParts, tmp_path: Path) -> None:
    tokens = ["<unk>", "a", "b" * 1_000_000]
    refused(with_vocabulary(parts, tokens).write(tmp_path / "long.gguf"), "token 2 is 1000000 characters long")


def test_a_four_megabyte_model_name(parts: GGUFParts, tmp_path: Path) -> None:
    path = parts.set("general.name", STRING, "n" * (4 << 20)).write(tmp_path / "name.gguf")
    refused(path, "general.name is 4194304 characters long")


def test_a_megabyte_chat_template(parts: GGUFParts, tmp_path: Path) -> None:
    path = parts.set("tokenizer.chat_template", STRING, "{{ 'x' }}" * (1 << 18)).write(tmp_path / "template.gguf")
    refused(path, "tokenizer.chat_template is", "characters long")


# -- inconsistent files: refused at start-up, not by every job ----------------------------------------

def test_tokenizer_ids_beyond_the_embedding(parts: GGUFParts, tmp_path: Path) -> None:
    embed = parts.tensor("token_embd.weight")
    rows = embed.shape[0] - 20
    embed.shape, embed.data = (rows, embed.shape[1]), embed.data[: rows * embed.shape[1] * 4]
    refused(parts.write(tmp_path / "small-embedding.gguf"), f"embedding holds only {rows} tokens")


# -- paths that are not regular files ---------------------------------------------------------------

@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_model_path_that_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    make: dict[str, Callable[[], Path]] = {
        "device": lambda: Path("/dev/zero"),
        "fifo": lambda: (os.mkfifo(tmp_path / "model.gguf"), tmp_path / "model.gguf")[1],
    }
    refused(make[kind](), "is not a regular file")


def test_a_chat_template_file_that_is_not_a_regular_file(parts: GGUFParts, tmp_path: Path) -> None:
    model = parts.write(tmp_path / "model.gguf")
    result = run_worker_to_exit("--model", str(model), "--chat-template-file", "/dev/zero", timeout=REFUSAL_SECONDS)
    assert_one_line_failure(result, "/dev/zero", "is not a regular file")


# -- a model's chat template is a program: bounded in time, memory and output -------------------------

HOSTILE_TEMPLATE = (
    "{% set m = messages[0].content %}"
    "{% if m == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif m == 'memory' %}{{ 'x' * (messages|length * 4000000000) }}"
    "{% elif m == 'wide' %}{{ 'x' * (messages|length * 40000000) }}"
    "{% elif m == 'include' %}{% include 'other' %}"
    "{% elif m == 'range' %}{{ range(10**9)|length }}"
    "{% else %}<start_of_turn>user\n{{ m }}<end_of_turn>\n<start_of_turn>model\n{% endif %}"
)


def test_a_hostile_chat_template_costs_one_400_each(parts: GGUFParts, tmp_path: Path) -> None:
    """Endless loops, gigabyte strings, includes and huge ranges in the model's own template: each
    chat request is a 400 naming the template, /health answers within a second throughout, and
    the next request is served."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import start_worker, stop_worker

    model = parts.set("tokenizer.chat_template", STRING, HOSTILE_TEMPLATE).write(tmp_path / "template.gguf")
    worker = start_worker(tmp_path, "--model", str(model))
    try:
        with worker.client() as client:

            def chat(content: str) -> dict[str, object]:
                body = {"model": model.stem, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
                response = client.post("/v1/chat/completions", json=body)
                return {"status": response.status_code, **response.json()}

            with ThreadPoolExecutor(1) as pool:
                looping = pool.submit(chat, "loop")
                health_seconds = []
                while not looping.done():
                    started = time.monotonic()
                    assert client.get("/health", timeout=5).status_code == 200
                    health_seconds.append(time.monotonic() - started)
                    time.sleep(0.1)
                answer = looping.result()
            assert health_seconds and max(health_seconds) < 1.0, health_seconds
            assert answer["status"] == 400 and "chat template took longer than" in answer["error"]["message"]
            assert answer["error"]["param"] == "messages"
            expected = {"memory": "MiB", "wide": "rendered more than", "include": "no loader",
                        "range": "Range too big"}
            for content, fragment in expected.items():
                answer = chat(content)
                assert answer["status"] == 400 and fragment in answer["error"]["message"], answer
            served = chat("hello")
            assert served["status"] == 200 and served["choices"], served
    finally:
        stop_worker(worker)


# -- sizes read from a file are checked before anything proportional to them is spent ---------------------
#
# Each file below claims a size (an array's count, a tensor's elements, a header's or a JSON file's
# bytes) far beyond what the model needs. The loader runs in a process of its own, so its peak
# memory (VmHWM) is this file's cost alone, measured against a pristine model's.

# What refusing (or skipping) a hostile claim may cost beyond loading the pristine tiny model.
HOSTILE_EXTRA_BYTES = 256 << 20
LOAD_AND_MEASURE = """
import json, sys
import torch
from llorch.errors import ModelFileError
from llorch.weights.loader import load_model
try:
    load_model(sys.argv[1], torch.device("cpu"), torch.float32, keep_quantized=True)
    outcome = "loaded"
except ModelFileError as exc:
    outcome = str(exc)
status = open("/proc/self/status").read().split("VmHWM:")[1].split()
print(json.dumps({"outcome": outcome, "peak_bytes": int(status[0]) * 1024}))
"""


def load_and_measure(path: Path) -> tuple[str, int]:
    """The loader's verdict on `path` ("loaded" or the refusal's line) and its process's peak memory."""
    result = subprocess.run([sys.executable, "-c", LOAD_AND_MEASURE, str(path)], capture_output=True, text=True,
                            timeout=REFUSAL_SECONDS)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    return answer["outcome"], answer["peak_bytes"]


@pytest.fixture(scope="module")
def pristine_peak(tmp_path_factory: pytest.TempPathFactory) -> int:
    """Peak memory of loading the pristine tiny models (the larger of the GGUF and the directory)."""
    workdir = tmp_path_factory.mktemp("pristine")
    peaks = []
    for path in (tiny_gemma3_parts(workdir).write(workdir / "model.gguf"), write_tiny_llama_dir(workdir / "dir")):
        outcome, peak = load_and_measure(path)
        assert outcome == "loaded", outcome
        peaks.append(peak)
    return max(peaks)


def cheaply(pristine_peak: int, path: Path, *fragments: str, extra: int = HOSTILE_EXTRA_BYTES) -> str:
    """The loader's outcome on `path`, after checking it names every fragment and cost at most `extra` bytes."""
    outcome, peak = load_and_measure(path)
    for fragment in fragments:
        assert fragment in outcome, outcome
    assert peak - pristine_peak < extra, (outcome, peak, pristine_peak)
    return outcome


def test_rope_freqs_of_four_million_factors(parts: GGUFParts, tmp_path: Path) -> None:
    """Its element count is compared with head_dim / 2 from the header, before one value is read."""
    parts.tensors.append(Tensor("rope_freqs.weight", (1 << 22,), F32_TENSOR, Zeros(4 << 22)))
    refused(parts.write(tmp_path / "rope.gguf"), "rope_freqs has 4194304 factors, expected 8")


def test_an_unused_array_costs_nothing(parts: GGUFParts, tmp_path: Path, pristine_peak: int) -> None:
    """A numeric array no one reads stays in the file: the model loads as if it were not there."""
    path = parts.set("general.padding", ARRAY, (U8, Zeros(64 << 20))).write(tmp_path / "unused.gguf")
    assert cheaply(pristine_peak, path) == "loaded"


def test_an_unused_array_of_two_billion_bytes_is_refused_before_the_file_is_hashed(
        parts: GGUFParts, tmp_path: Path, pristine_peak: int) -> None:
    """The header is bounded, and checked before the file is read whole for its digest: hashing the
    sparse 2 GiB alone took 17 s."""
    path = parts.set("general.padding", ARRAY, (U8, Zeros(1 << 31))).write(tmp_path / "unused.gguf")
    cheaply(pristine_peak, path, "the header runs past 268435456 bytes (at general.padding)")


def test_gigabytes_after_the_last_tensor(parts: GGUFParts, tmp_path: Path, pristine_peak: int) -> None:
    path = parts.write(tmp_path / "trailing.gguf")
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size + (2 << 30))
    cheaply(pristine_peak, path, "2147483648 bytes follow the last tensor; at most 1048576 may")


@pytest.mark.parametrize(("key", "element", "count", "fragments"), [
    ("tokenizer.ggml.token_type", I32, 1 << 27, ("tokenizer.ggml.token_type holds 134217728 values",
                                                  "at most 1048576")),
    ("tokenizer.ggml.scores", F32, 1 << 27, ("tokenizer.ggml.scores holds 134217728 values",)),
    ("tokenizer.ggml.tokens", STRING, 1 << 26, ("tokenizer.ggml.tokens holds 67108864 strings", "at most 1048576")),
    ("tokenizer.ggml.merges", STRING, 1 << 26, ("tokenizer.ggml.merges holds 67108864 strings", "at most 2097152")),
    ("general.padding", STRING, 1 << 26, ("general.padding holds 67108864 strings", "at most 65536")),
], ids=["token-types", "scores", "tokens", "merges", "unused-strings"])
def test_arrays_longer_than_any_vocabulary(parts: GGUFParts, tmp_path: Path, pristine_peak: int, key: str,
                                           element: int, count: int, fragments: tuple[str, ...]) -> None:
    """Counted against the vocabulary's bound before an element is read (empty strings in a sparse file)."""
    path = parts.set(key, ARRAY, (element, Zeros(count))).write(tmp_path / "array.gguf")
    cheaply(pristine_peak, path, str(path), "corrupt GGUF", *fragments)


def test_a_token_type_array_that_does_not_match_the_vocabulary(parts: GGUFParts, tmp_path: Path) -> None:
    path = parts.set("tokenizer.ggml.token_type", ARRAY, (I32, [1] * 5)).write(tmp_path / "types.gguf")
    refused(path, "tokenizer.ggml.token_type holds 5 values for 279 tokens")


def test_a_one_gigabyte_chat_template(parts: GGUFParts, tmp_path: Path, pristine_peak: int) -> None:
    path = parts.set("tokenizer.chat_template", STRING, Zeros(1 << 30)).write(tmp_path / "template.gguf")
    cheaply(pristine_peak, path, "tokenizer.chat_template is 1073741824 bytes long", "at most 4194304")


def test_more_metadata_entries_than_any_model_has(parts: GGUFParts, tmp_path: Path, pristine_peak: int) -> None:
    path = parts.write(tmp_path / "entries.gguf")
    with path.open("r+b") as handle:
        handle.seek(16)  # the metadata count, after the magic, the version and the tensor count
        handle.write((1 << 24).to_bytes(8, "little"))
        handle.truncate(1 << 28)  # room enough for the claim
    cheaply(pristine_peak, path, "16777216 metadata entries", "at most 65536")


def test_a_gigabyte_norm_is_refused_by_its_shape(parts: GGUFParts, tmp_path: Path, pristine_peak: int) -> None:
    """Tensor shapes are compared with the config's before a tensor is read or dequantized."""
    norm = parts.tensor("output_norm.weight")
    norm.shape, norm.data = (1 << 28,), Zeros(1 << 30)
    path = parts.write(tmp_path / "norm.gguf")
    cheaply(pristine_peak, path, "weight norm.weight has shape (268435456,), the config implies (32,)")


# -- Hugging Face directories -------------------------------------------------------------------

@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_tiny_llama_dir(tmp_path / "model")


def test_the_pristine_directory_loads(model_dir: Path) -> None:
    """The directory writer is sound, so each refusal below is caused by the one thing it breaks."""
    import torch

    from llorch.weights.loader import load_model

    loaded = load_model(model_dir, torch.device("cpu"), torch.float32)
    assert loaded.config.num_layers == 1 and loaded.tokenizer.backend.get_vocab_size() == 30


def junk_json(document: dict[str, object], size: int) -> str:
    """`document` with a key of junk numbers making it `size` bytes or more (valid JSON throughout)."""
    return json.dumps({**document, "junk": [0] * (size // 3)})


def test_a_config_of_sixteen_megabytes(model_dir: Path) -> None:
    """A real config.json is a few kilobytes: a large one is refused before it is parsed."""
    (model_dir / "config.json").write_text(junk_json(tiny_llama_config(), 16 << 20))
    result = run_worker_to_exit("--model", str(model_dir), timeout=REFUSAL_SECONDS)
    assert_one_line_failure(result, str(model_dir / "config.json"), "a config.json may have at most 1048576")


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json"])
def test_side_files_of_sixteen_megabytes(model_dir: Path, pristine_peak: int, name: str) -> None:
    (model_dir / name).write_text(junk_json({}, 16 << 20))
    cheaply(pristine_peak, model_dir, str(model_dir / name), f"a {name} may have at most")


def test_a_sparse_tokenizer_of_one_and_a_half_gigabytes(model_dir: Path, pristine_peak: int) -> None:
    file = model_dir / "tokenizer.json"
    write_sparse(file, [tokenizer_json(["<unk>"]).encode(), Zeros(3 << 29)])
    cheaply(pristine_peak, model_dir, str(file), f"is {file.stat().st_size} bytes", "at most 67108864")


def test_a_tokenizer_of_two_and_a_half_million_tokens(model_dir: Path, pristine_peak: int) -> None:
    """Counted (as the strings it holds) before `tokenizers` builds it: it is never built."""
    (model_dir / "tokenizer.json").write_text(tokenizer_json(f"{i:x}" for i in range(5 << 19)))
    cheaply(pristine_peak, model_dir, str(model_dir / "tokenizer.json"), "strings; a tokenizer of at most 1048576 "
            "tokens may hold")


def test_a_tokenizer_of_more_tokens_than_allowed(model_dir: Path, pristine_peak: int) -> None:
    """Few enough strings to be built (costing what Gemma 3's real tokenizer does), too many tokens to be
    served: refused before the vocabulary becomes Python objects, which used to cost 600 MB more."""
    (model_dir / "tokenizer.json").write_text(tokenizer_json(f"{i:x}" for i in range((1 << 20) + 1)))
    cheaply(pristine_peak, model_dir, str(model_dir / "tokenizer.json"),
            "holds 1048577 tokens; at most 1048576 are allowed", extra=400 << 20)


def test_safetensors_of_eighty_thousand_tensors(model_dir: Path, pristine_peak: int) -> None:
    tensors = {**tiny_llama_tensors(), **{f"extra.{i}": SafeTensor("F32", (1,)) for i in range(80_000)}}
    file = write_safetensors(model_dir / "model.safetensors", tensors)
    cheaply(pristine_peak, model_dir, str(file), "describes more than 65536 tensors")


def test_a_safetensors_header_of_ninety_megabytes(model_dir: Path, pristine_peak: int) -> None:
    file = write_safetensors(model_dir / "model.safetensors", tiny_llama_tensors(), header_padding=90 << 20)
    cheaply(pristine_peak, model_dir, str(file), "has a header of", "at most 8388608 are read")


def test_f64_safetensors_are_refused_by_name(model_dir: Path) -> None:
    """README lists F32, F16 and BF16; a float64 checkpoint is refused, not silently converted."""
    tensors = tiny_llama_tensors()
    tensors["model.norm.weight"] = SafeTensor("F64", (32,))
    file = write_safetensors(model_dir / "model.safetensors", tensors)
    result = run_worker_to_exit("--model", str(model_dir), timeout=REFUSAL_SECONDS)
    assert_one_line_failure(result, str(file), "tensor model.norm.weight has dtype F64, which is not supported",
                            "BF16, F16, F32")


def test_a_gigabyte_safetensors_norm_is_refused_by_its_shape(model_dir: Path, pristine_peak: int) -> None:
    tensors = tiny_llama_tensors()
    tensors["model.norm.weight"] = SafeTensor("F32", (1 << 28,), Zeros(1 << 30))
    write_safetensors(model_dir / "model.safetensors", tensors)
    cheaply(pristine_peak, model_dir, "weight norm.weight has shape (268435456,), the config implies (32,)")
