"""The GGUF reader: dequantization equals the gguf package's, and bad files fail clearly."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize

from llorch.errors import ModelFileError
from llorch.weights.gguf import GGUFFile

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def default_gguf(model_path: Path) -> GGUFFile:
    return GGUFFile(model_path)


def test_reads_default_model_header(default_gguf: GGUFFile) -> None:
    assert default_gguf.metadata["general.architecture"] == "gemma3"
    assert len(default_gguf.tensors) == 236
    assert default_gguf.tensors["token_embd.weight"].shape == (262144, 640)
    assert len(default_gguf.metadata["tokenizer.ggml.tokens"]) == 262144
    kinds = {info.qtype for info in default_gguf.tensors.values()}
    assert kinds == {GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0,
                     GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K}


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_dequantize_matches_gguf_package(default_gguf: GGUFFile, qtype: str) -> None:
    name = next(n for n, info in default_gguf.tensors.items() if info.qtype.name == qtype and n != "token_embd.weight")
    ours = default_gguf.dequantize(name)
    info = default_gguf.tensors[name]
    expected = torch.from_numpy(reference_dequantize(np.array(default_gguf.raw(name)), info.qtype)).reshape(info.shape)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, expected)
    assert np.array_equal(default_gguf.dequantize_array(name), expected.numpy())  # the C step's loader's


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0])
def test_norms_of_every_float_type_read_as_gguf_reads_them(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    """A norm stored in a 16-bit or block type reads, without torch, to the reference's values and torch's."""
    values = np.random.default_rng(0).standard_normal(64).astype(np.float32) * 3
    writer = gguf.GGUFWriter(str(tmp_path / "norm.gguf"), "llama")
    writer.add_tensor("norm.weight", gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(tmp_path / "norm.gguf")
    expected = reference_dequantize(np.array(file.raw("norm.weight")), qtype).reshape(64)
    ours = file.dequantize_array("norm.weight")
    assert ours.dtype == np.float32
    assert np.array_equal(ours, expected)
    assert np.array_equal(ours, file.dequantize("norm.weight").numpy())


def test_q8_0_fast_path_matches_on_the_embedding(default_gguf: GGUFFile) -> None:
    raw = default_gguf.raw("token_embd.weight")[:4096]
    ours = default_gguf.dequantize("token_embd.weight")[:4096]
    expected = torch.from_numpy(reference_dequantize(np.array(raw), GGMLQuantizationType.Q8_0))
    assert torch.equal(ours, expected)


def test_truncated_file_names_the_tensor_and_the_file(model_path: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(model_path.read_bytes()[: 50_000_000])
    with pytest.raises(ModelFileError, match=r"truncated\.gguf.*runs past the end of the file"):
        GGUFFile(truncated)


def test_header_cut_inside_metadata(model_path: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_path.read_bytes()[:100_000])
    with pytest.raises(ModelFileError, match="corrupt GGUF"):
        GGUFFile(cut)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFFile(bogus)


def test_absurd_counts_are_rejected_before_allocating(tmp_path: Path) -> None:
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1 << 60).to_bytes(8, "little")
                        + (1 << 60).to_bytes(8, "little") + bytes(64))
    with pytest.raises(ModelFileError, match="exceed the file size"):
        GGUFFile(crafted)
