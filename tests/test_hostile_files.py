"""Hostile model files cost nothing: each is refused by a real worker in one line, at once.

Every file here is a tiny valid GGUF (tests/tiny_model.py) with one thing made wrong, as
an attacker or a careless conversion tool would: absurd counts that used to allocate
gigabytes, values of the wrong type, overlapping or repeated tensors, vocabularies built
to make tokenizer recovery explode, megabyte names, inconsistent sizes, and paths that
are not regular files.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_failure, run_worker_to_exit
from hostile_files import (
    ARRAY,
    F32,
    F64,
    I32,
    Q8_0_TENSOR,
    STRING,
    U64,
    GGUFParts,
    q8_0_bytes,
    tiny_gemma3_parts,
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
