"""Hostile model files, built by the tests: a tiny valid GGUF taken apart and written back with
whatever a careless tool or an attacker would put in it (duplicate keys, overlapping tensors,
misaligned offsets, absurd counts, values of the wrong type), and a tiny valid Hugging Face
directory to break the same way.

The writers are our own because the gguf and safetensors writers refuse to produce most of these.
`Zeros(n)` stands for n zero bytes (or n elements of an array) left as a hole in a sparse file: a
claim of gigabytes that costs nothing on disk.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from llorch.weights.gguf import GGUFFile
from tiny_model import write_tiny_gemma3

# GGUF metadata value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
_SCALARS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
            U64: "<Q", I64: "<q", F64: "<d"}
_ARRAY_TYPES = {np.dtype("int32"): I32, np.dtype("float32"): F32, np.dtype("uint32"): U32, np.dtype("int64"): I64,
                np.dtype("uint8"): U8, np.dtype("int8"): I8, np.dtype("float64"): F64}
F32_TENSOR, Q8_0_TENSOR = 0, 8


@dataclass(frozen=True)
class Zeros:
    """`count` zero bytes, or array elements of zeros (empty strings in a string array), written as a hole."""

    count: int


Chunk = bytes | Zeros


def write_sparse(path: Path, chunks: Iterable[Chunk]) -> Path:
    """The chunks one after another; each Zeros is skipped over, so the file stays sparse."""
    with path.open("wb") as handle:
        for chunk in chunks:
            _write_chunk(handle, chunk)
        handle.truncate(handle.tell())  # a hole at the end still counts in the file's size
    return path


def _write_chunk(handle: BinaryIO, chunk: Chunk) -> None:
    if isinstance(chunk, Zeros):
        handle.seek(chunk.count, 1)
    else:
        handle.write(chunk)


def _length(chunk: Chunk) -> int:
    return chunk.count if isinstance(chunk, Zeros) else len(chunk)


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # torch order, slowest dimension first
    ggml_type: int
    data: Chunk
    offset: int | None = None  # relative to the data section; None: packed after the previous one


@dataclass
class GGUFParts:
    metadata: list[tuple[str, int, Any]] = field(default_factory=list)  # (key, value type, value)
    tensors: list[Tensor] = field(default_factory=list)
    alignment: int = 32  # how the writer pads; the file's general.alignment is metadata like any other

    def set(self, key: str, vtype: int, value: Any) -> GGUFParts:
        """Replace `key` (or add it)."""
        self.metadata = [(k, t, v) for k, t, v in self.metadata if k != key] + [(key, vtype, value)]
        return self

    def drop(self, key: str) -> GGUFParts:
        self.metadata = [(k, t, v) for k, t, v in self.metadata if k != key]
        return self

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def write(self, path: Path) -> Path:
        chunks: list[Chunk] = [b"GGUF" + struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata))]
        for key, vtype, value in self.metadata:
            chunks += [_string(key) + struct.pack("<I", vtype), *_value(vtype, value)]
        placed, cursor = [], 0
        for tensor in self.tensors:
            offset = cursor if tensor.offset is None else tensor.offset
            placed.append(offset)
            cursor = max(cursor, offset + -(-_length(tensor.data) // self.alignment) * self.alignment)
        for tensor, offset in zip(self.tensors, placed, strict=True):
            dims = list(reversed(tensor.shape))
            chunks.append(_string(tensor.name) + struct.pack("<I", len(dims))
                          + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", tensor.ggml_type, offset))
        header = sum(_length(chunk) for chunk in chunks)
        chunks.append(b"\0" * (-header % self.alignment))
        data_start = header + _length(chunks[-1])
        with path.open("wb") as handle:
            for chunk in chunks:
                _write_chunk(handle, chunk)
            for tensor, offset in zip(self.tensors, placed, strict=True):
                if isinstance(tensor.data, bytes):  # holes are zeros already
                    handle.seek(data_start + offset)
                    handle.write(tensor.data)
            handle.truncate(data_start + cursor)
        return path


def _string(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value: Any) -> list[Chunk]:
    if vtype in _SCALARS:
        return [struct.pack(_SCALARS[vtype], value)]
    if vtype == STRING:
        if isinstance(value, Zeros):  # a string of that many NUL bytes
            return [struct.pack("<Q", value.count), value]
        return [_string(value)]
    assert vtype == ARRAY
    element_type, items = value
    if isinstance(items, Zeros):  # that many zero elements; a string's zero is its 8-byte length
        width = 8 if element_type == STRING else struct.calcsize(_SCALARS[element_type])
        return [struct.pack("<IQ", element_type, items.count), Zeros(items.count * width)]
    head = struct.pack("<IQ", element_type, len(items))
    if element_type == STRING:
        return [head + b"".join(_string(item) for item in items)]
    return [head + b"".join(struct.pack(_SCALARS[element_type], item) for item in items)]


def _typed(value: Any) -> tuple[int, Any]:
    """The value type the gguf writer gave a value read back from a file."""
    if isinstance(value, bool):
        return BOOL, value
    if isinstance(value, int):
        return U32, value
    if isinstance(value, float):
        return F32, value
    if isinstance(value, str):
        return STRING, value
    if isinstance(value, list):
        return ARRAY, (STRING, value)
    assert isinstance(value, np.ndarray), type(value)
    return ARRAY, (_ARRAY_TYPES[value.dtype], value.tolist())


def tiny_gemma3_parts(workdir: Path) -> GGUFParts:
    """The tiny test Gemma 3 (tiny_model.py), taken apart: every key and tensor, ready to be broken."""
    source = GGUFFile(write_tiny_gemma3(workdir / "pristine.gguf"))
    parts = GGUFParts()
    for key, value in source.metadata.items():
        parts.metadata.append((key, *_typed(value)))
    for name, info in source.tensors.items():
        parts.tensors.append(Tensor(name, info.shape, int(info.qtype), source.raw(name).tobytes()))
    return parts


def q8_0_bytes(values: np.ndarray) -> bytes:
    """`values` (a multiple of 32 of them) as Q8_0 blocks: one f16 scale and 32 int8 values each."""
    blocks = values.astype(np.float32).reshape(-1, 32)
    scales = np.maximum(np.abs(blocks).max(axis=1), 1e-8) / 127
    quants = np.round(blocks / scales[:, None]).astype(np.int8)
    return b"".join(np.float16(s).tobytes() + q.tobytes() for s, q in zip(scales, quants, strict=True))


# -- a tiny Hugging Face directory (Llama layout), written without transformers --------------------------

HF_HIDDEN, HF_HEADS, HF_KV_HEADS, HF_HEAD_DIM, HF_FFN = 32, 2, 1, 16, 64
HF_TOKENS = ["<unk>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz "]
SAFETENSORS_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


@dataclass
class SafeTensor:
    dtype: str
    shape: tuple[int, ...]
    data: Chunk | None = None  # None: random values of the dtype's size


def tiny_llama_config(vocab_size: int = len(HF_TOKENS)) -> dict[str, Any]:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HF_HIDDEN,
        "intermediate_size": HF_FFN, "num_hidden_layers": 1, "num_attention_heads": HF_HEADS,
        "num_key_value_heads": HF_KV_HEADS, "head_dim": HF_HEAD_DIM, "vocab_size": vocab_size,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    }


def tiny_llama_tensors(vocab_size: int = len(HF_TOKENS)) -> dict[str, SafeTensor]:
    """Every weight of tiny_llama_config, under Hugging Face's names."""
    q, kv = HF_HEADS * HF_HEAD_DIM, HF_KV_HEADS * HF_HEAD_DIM
    layer = {
        "input_layernorm.weight": (HF_HIDDEN,), "post_attention_layernorm.weight": (HF_HIDDEN,),
        "self_attn.q_proj.weight": (q, HF_HIDDEN), "self_attn.k_proj.weight": (kv, HF_HIDDEN),
        "self_attn.v_proj.weight": (kv, HF_HIDDEN), "self_attn.o_proj.weight": (HF_HIDDEN, q),
        "mlp.gate_proj.weight": (HF_FFN, HF_HIDDEN), "mlp.up_proj.weight": (HF_FFN, HF_HIDDEN),
        "mlp.down_proj.weight": (HF_HIDDEN, HF_FFN),
    }
    tensors = {"model.embed_tokens.weight": SafeTensor("F32", (vocab_size, HF_HIDDEN)),
               "model.norm.weight": SafeTensor("F32", (HF_HIDDEN,))}
    tensors.update((f"model.layers.0.{name}", SafeTensor("F32", shape)) for name, shape in layer.items())
    return tensors


def write_safetensors(path: Path, tensors: dict[str, SafeTensor], header_padding: int = 0) -> Path:
    """A safetensors file: its JSON header, then each tensor's bytes (holes where they are Zeros)."""
    rng = np.random.default_rng(0)
    header: dict[str, Any] = {}
    chunks: list[Chunk] = []
    cursor = 0
    for name, tensor in tensors.items():
        size = math.prod(tensor.shape) * SAFETENSORS_SIZES[tensor.dtype]
        data = tensor.data
        if data is None:
            data = (rng.standard_normal(size // 4) * 0.2).astype(np.float32).tobytes()[:size].ljust(size, b"\0")
        header[name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [cursor, cursor + size]}
        chunks.append(data)
        cursor += size
    text = json.dumps(header, separators=(",", ":")).encode() + b" " * header_padding
    return write_sparse(path, [struct.pack("<Q", len(text)), text, *chunks])


def tokenizer_json(tokens: Iterable[str]) -> str:
    """A word-level tokenizer.json whose vocabulary is `tokens`, numbered in order."""
    vocab = ",".join(f"{json.dumps(token)}:{index}" for index, token in enumerate(tokens))
    return ('{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,'
            '"pre_tokenizer":null,"post_processor":null,"decoder":null,'
            f'"model":{{"type":"WordLevel","vocab":{{{vocab}}},"unk_token":"<unk>"}}}}')


def write_tiny_llama_dir(directory: Path) -> Path:
    """A loadable Hugging Face directory: config.json, tokenizer.json and model.safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_llama_config()))
    (directory / "tokenizer.json").write_text(tokenizer_json(HF_TOKENS))
    write_safetensors(directory / "model.safetensors", tiny_llama_tensors())
    return directory
