"""Hostile model files, built by the tests: a tiny valid GGUF taken apart and written back with
whatever a careless tool or an attacker would put in it (duplicate keys, overlapping tensors,
misaligned offsets, absurd counts, values of the wrong type).

The writer is our own because the gguf package's writer refuses to produce most of these.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # torch order, slowest dimension first
    ggml_type: int
    data: bytes
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
        out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata)))
        for key, vtype, value in self.metadata:
            out += _string(key) + struct.pack("<I", vtype) + _value(vtype, value)
        placed, cursor = [], 0
        for tensor in self.tensors:
            offset = cursor if tensor.offset is None else tensor.offset
            placed.append(offset)
            cursor = max(cursor, offset + -(-len(tensor.data) // self.alignment) * self.alignment)
        for tensor, offset in zip(self.tensors, placed, strict=True):
            dims = list(reversed(tensor.shape))
            out += _string(tensor.name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            out += struct.pack("<IQ", tensor.ggml_type, offset)
        out += b"\0" * (-len(out) % self.alignment)
        data = bytearray(cursor)
        for tensor, offset in zip(self.tensors, placed, strict=True):
            data[offset:offset + len(tensor.data)] = tensor.data
        path.write_bytes(bytes(out + data))
        return path


def _string(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value: Any) -> bytes:
    if vtype in _SCALARS:
        return struct.pack(_SCALARS[vtype], value)
    if vtype == STRING:
        return _string(value)
    assert vtype == ARRAY
    element_type, items = value
    head = struct.pack("<IQ", element_type, len(items))
    if element_type == STRING:
        return head + b"".join(_string(item) for item in items)
    return head + b"".join(struct.pack(_SCALARS[element_type], item) for item in items)


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
