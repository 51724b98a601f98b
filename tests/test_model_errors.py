"""Broken model directories and files: each gives one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import all_logits, assert_one_line_failure, run_worker_to_exit
from llorch.weights.loader import load_model
from model_zoo import ARCHITECTURES, Q, build_hf_model, export_gguf, train_tokenizer

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_model(ARCHITECTURES["llama"], tmp_path_factory.mktemp("pristine") / "tiny-llama",
                          train_tokenizer())


@pytest.fixture
def model_dir(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of a good tiny model directory, for one test to break."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


def shard(directory: Path) -> list[str]:
    """Split model.safetensors into two shards plus the index, as large checkpoints ship."""
    tensors = load_file(directory / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({name: tensors[name] for name in part}, directory / file)
    (directory / "model.safetensors").unlink()
    weight_map = {name: file for file, part in shards.items() for name in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return list(shards)


def edit_config(directory: Path, **changes: object) -> None:
    file = directory / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def test_a_sharded_checkpoint_loads_like_a_single_file(pristine: Path, model_dir: Path) -> None:
    shard(model_dir)
    single = load_model(pristine, torch.device("cpu"), torch.float32)
    sharded = load_model(model_dir, torch.device("cpu"), torch.float32)
    ids = single.tokenizer.encode("The quick brown fox")
    assert torch.equal(all_logits(sharded, ids), all_logits(single, ids))


def test_a_worker_serves_a_model_directory(model_dir: Path) -> None:
    """The CPU worker accepts a directory for --model, and a broken one is refused (see below)."""
    from conftest import start_worker, stop_worker

    worker = start_worker(model_dir.parent, "--model", str(model_dir))
    try:
        with worker.client() as client:
            body = {"job_id": "dir-1", "prompt": "The quick", "max_tokens": 4, "temperature": 0}
            response = client.post("/execute", json=body)
            assert response.status_code == 200
            assert '"type": "end"' in response.text or '"type":"end"' in response.text
    finally:
        stop_worker(worker)


def test_truncated_safetensors(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_one_line_failure(run_worker_to_exit("--model", str(model_dir)), str(weights), "not a valid safetensors file")


def test_shard_listed_in_the_index_but_missing(model_dir: Path) -> None:
    files = shard(model_dir)
    (model_dir / files[1]).unlink()
    assert_one_line_failure(run_worker_to_exit("--model", str(model_dir)), files[1], "listed in", "but missing")


def test_tensor_shapes_that_disagree_with_config(model_dir: Path) -> None:
    edit_config(model_dir, intermediate_size=384)
    assert_one_line_failure(run_worker_to_exit("--model", str(model_dir)), "layers.0.mlp", "(512, 256)", "(384, 256)")


def test_missing_tokenizer(model_dir: Path) -> None:
    (model_dir / "tokenizer.json").unlink()
    assert_one_line_failure(run_worker_to_exit("--model", str(model_dir)), "has no tokenizer.json")


def test_unsupported_architecture(model_dir: Path) -> None:
    edit_config(model_dir, model_type="gpt_neox")
    assert_one_line_failure(run_worker_to_exit("--model", str(model_dir)), "unknown architecture", "gpt_neox")


def test_unsupported_quantization_type_is_named(pristine: Path, tmp_path: Path) -> None:
    path = export_gguf(pristine, tmp_path / "iq.gguf", Q.F32, raw_types={"blk.0.ffn_down.weight": Q.IQ4_NL})
    assert_one_line_failure(run_worker_to_exit("--model", str(path)), "blk.0.ffn_down.weight", "IQ4_NL",
                            "not supported")


def test_pickle_only_checkpoint_directory(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    assert_one_line_failure(run_worker_to_exit("--model", str(model_dir)), "pytorch_model.bin", "pickle")


def test_missing_config(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    assert_one_line_failure(run_worker_to_exit("--model", str(model_dir)), "config.json", "is missing")


# -- hostile config.json values: each refused in one line, before anything is sized by it ----------

@pytest.mark.parametrize(("changes", "fragments"), [
    ({"num_hidden_layers": 1e8}, ("num_hidden_layers is 100000000", "between 1 and")),
    ({"num_attention_heads": 0}, ("num_attention_heads is 0",)),
    ({"hidden_size": "big"}, ("hidden_size must be an integer", "'big'")),
    ({"hidden_act": ["silu"]}, ("activation ['silu'] is not supported",)),
    ({"rms_norm_eps": [1e-6]}, ("rms_norm_eps must be a finite number",)),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear"}}, ("RoPE scaling 'linear' needs 'factor'",)),
    ({"rope_parameters": None, "rope_scaling": ["linear"]}, ("rope_scaling must be an object",)),
    ({"layer_types": ["sliding_attention"] * 2}, ("sliding-window layers but no 'sliding_window'",)),
    ({"sliding_window": -4}, ("sliding_window is -4",)),
    ({"max_position_embeddings": 0}, ("max_position_embeddings is 0",)),
], ids=["layers-1e8", "zero-heads", "string-width", "list-activation", "list-eps", "rope-no-factor",
        "rope-list", "sliding-no-window", "negative-window", "zero-context"])
def test_hostile_config_values(model_dir: Path, changes: dict[str, object], fragments: tuple[str, ...]) -> None:
    edit_config(model_dir, **changes)
    assert_one_line_failure(run_worker_to_exit("--model", str(model_dir), timeout=60), "config.json", *fragments)


def test_a_config_nested_a_hundred_thousand_deep(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    assert_one_line_failure(run_worker_to_exit("--model", str(model_dir), timeout=60), "config.json",
                            "nests too deeply")


@pytest.mark.parametrize("entry", ["../other/model.safetensors", "/etc/passwd", 5],
                         ids=["parent", "absolute", "not-a-string"])
def test_an_index_entry_outside_the_directory(model_dir: Path, entry: object) -> None:
    """weight_map names files inside the model directory; nothing else is ever opened."""
    shard(model_dir)
    index = model_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map[next(iter(weight_map))] = entry
    index.write_text(json.dumps({"weight_map": weight_map}))
    result = run_worker_to_exit("--model", str(model_dir), timeout=60)
    expected = "is not a file name" if not isinstance(entry, str) else "points outside the model directory"
    assert_one_line_failure(result, "model.safetensors.index.json", expected)


def test_a_tokenizer_larger_than_the_embedding(model_dir: Path) -> None:
    """Token ids the embedding has no row for would fail every job; the file is refused at start-up."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    edit_config(model_dir, vocab_size=vocab - 8)
    result = run_worker_to_exit("--model", str(model_dir), timeout=60)
    assert_one_line_failure(result, f"embedding holds only {vocab - 8} tokens")


def test_a_tokenizer_regex_that_fails_is_a_400_for_that_request(model_dir: Path) -> None:
    """A pre-tokenizer regex that backtracks past the regex engine's limit on some text fails
    the requests carrying that text (400), not the server (500); other requests are served."""
    from conftest import start_worker, stop_worker

    file = model_dir / "tokenizer.json"
    spec = json.loads(file.read_text())
    catastrophic = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [catastrophic, spec["pre_tokenizer"]]} if spec.get(
        "pre_tokenizer") else catastrophic
    file.write_text(json.dumps(spec))
    hostile = "a" * 40 + "b"
    worker = start_worker(model_dir.parent, "--model", str(model_dir))
    try:
        with worker.client() as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            answers = {
                "prompt": client.post("/v1/completions", json={"model": model, "prompt": hostile, "max_tokens": 2}),
                "execute": client.post("/execute", json={"job_id": "regex-1", "prompt": hostile, "max_tokens": 2}),
                "tokenize": client.post("/tokenize", json={"prompt": hostile}),
            }
            for name, answer in answers.items():
                assert answer.status_code == 400, (name, answer.text)
                assert "tokenizer failed" in answer.text, (name, answer.text)
            assert answers["prompt"].json()["error"]["param"] == "prompt"
            served = client.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2})
            assert served.status_code == 200, served.text
    finally:
        stop_worker(worker)
