"""GGUF files: a strict, fast header reader and tensor dequantization.

We parse the header ourselves instead of using `gguf.GGUFReader` for two reasons:
- speed: that reader builds one numpy view per string, which takes ~12 s for a
  262k-token vocabulary; this reader takes a fraction of a second;
- strictness: a model file is untrusted input, so every count, length, shape and
  offset is checked against the file size and `limits` before anything is allocated
  or read. Numeric arrays stay views of the mapped file: one no one reads costs nothing,
  whatever count it claims.
The `gguf` package still supplies the format's constants and the reference
dequantizers for the block types.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from llorch.errors import ModelFileError
from llorch.weights import limits
from llorch.weights.tensor_read import TensorRead

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 16
MAX_DIMS = 8
# Types whose numpy element type we know; everything else is a block type dequantized by gguf.
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
}
Q = GGMLQuantizationType
# The tensor types we load. Others (the IQ and ternary types, MXFP4, ...) are refused by
# name rather than dequantized by a path no test covers.
SUPPORTED_TENSOR_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})

# GGUF metadata value types (the numbering is part of the file format).
_SCALAR_FORMATS: dict[int, tuple[str, np.dtype]] = {
    0: ("<B", np.dtype("<u1")),
    1: ("<b", np.dtype("<i1")),
    2: ("<H", np.dtype("<u2")),
    3: ("<h", np.dtype("<i2")),
    4: ("<I", np.dtype("<u4")),
    5: ("<i", np.dtype("<i4")),
    6: ("<f", np.dtype("<f4")),
    7: ("<?", np.dtype("?")),
    10: ("<Q", np.dtype("<u8")),
    11: ("<q", np.dtype("<i8")),
    12: ("<d", np.dtype("<f8")),
}
_STRING = 8
_ARRAY = 9
_LENGTH = struct.Struct("<Q")  # a string's length


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: the slowest-varying dimension first
    qtype: GGMLQuantizationType
    offset: int  # absolute offset of the tensor's bytes in the file
    nbytes: int


class GGUFFile:
    """A memory-mapped GGUF file: its metadata and its tensors, read lazily."""

    def __init__(self, path: str | Path, table: list[list[Any]] | None = None) -> None:
        """Parse the file's header, or take its tensor table from a cache (`table`, see `tensor_table`):
        then only the tensors are known, not the metadata, and nothing of the header is read."""
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(self.path, "no such file")
        self.size = self.path.stat().st_size
        try:
            with self.path.open("rb") as handle:
                # Private and copy-on-write: tensors can view the file's pages without a copy (nothing writes them).
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise ModelFileError(self.path, f"cannot be memory-mapped ({exc})") from exc
        self._pos = 0
        self._array_text_left = limits.MAX_METADATA_ARRAY_BYTES
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        if table is None:
            self._parse()
            return
        for name, shape, qtype, offset, nbytes in table:
            info = GGUFTensorInfo(name, tuple(shape), GGMLQuantizationType(qtype), offset, nbytes)
            if offset < 0 or offset + nbytes > self.size:
                raise self._fail(f"cached tensor {name} lies outside the file")
            self.tensors[name] = info
        self._check_disjoint()

    def tensor_table(self) -> list[list[Any]]:
        """The tensors' names, shapes, types and places: what a warm start needs instead of the header."""
        return [[t.name, list(t.shape), int(t.qtype), t.offset, t.nbytes] for t in self.tensors.values()]

    # -- header parsing -------------------------------------------------------------------
    def _fail(self, problem: str) -> ModelFileError:
        return ModelFileError(self.path, f"corrupt GGUF: {problem}")

    def _skip(self, n: int, what: str) -> int:
        """Where the next `n` bytes start; the cursor moves past them (nothing is read)."""
        if n < 0 or self._pos + n > self.size:
            raise self._fail(f"{what} runs past the end of the file (offset {self._pos}, {n} bytes)")
        start = self._pos
        self._pos += n
        return start

    def _take(self, n: int, what: str) -> bytes:
        start = self._skip(n, what)
        return self._map[start : start + n]

    def _unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), what))[0]

    def _string(self, what: str, limit: int) -> str:
        """A string of at most `limit` bytes: its length is checked before its bytes are copied
        (a sparse file can claim gigabytes at no cost on disk)."""
        length = self._unpack("<Q", f"{what} length")
        start = self._skip(length, what)
        if length > limit:
            raise self._fail(f"{what} is {length} bytes long; at most {limit} are read")
        try:
            return self._map[start : start + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._fail(f"{what} is not UTF-8") from exc

    def _strings(self, key: str, count: int) -> list[str]:
        """A string array: its count bounded by what the key may hold, and the text of all
        string arrays together by MAX_METADATA_ARRAY_BYTES, before any element is read."""
        limit = limits.VOCABULARY_ARRAYS.get(key, limits.MAX_METADATA_ARRAY_STRINGS)
        # Every string needs at least its 8-byte length: reject absurd counts up front.
        if count * 8 > self.size - self._pos:
            raise self._fail(f"{key} claims {count} strings, more than the file can hold")
        if count > limit:
            raise self._fail(f"metadata {key} holds {count} strings; at most {limit} are read")
        # The loop of a 262k vocabulary: locals and unpack_from, no method call per string.
        data, size, pos, left, strings = self._map, self.size, self._pos, self._array_text_left, []
        try:
            for _ in range(count):
                (length,) = _LENGTH.unpack_from(data, pos)  # in the file: the count check above covers it
                pos += 8
                if pos + length > size:
                    raise self._fail(f"{key} runs past the end of the file (offset {pos}, {length} bytes)")
                left -= length
                if left < 0:
                    raise self._fail(f"the strings of the metadata arrays exceed {limits.MAX_METADATA_ARRAY_BYTES} "
                                     f"bytes (at {key})")
                strings.append(data[pos : pos + length].decode("utf-8"))
                pos += length
        except struct.error as exc:
            raise self._fail(f"{key} runs past the end of the file (offset {pos})") from exc
        except UnicodeDecodeError as exc:
            raise self._fail(f"{key} is not UTF-8") from exc
        self._pos, self._array_text_left = pos, left
        return strings

    def _numbers(self, key: str, dtype: np.dtype, count: int) -> np.ndarray:
        """A numeric array as a read-only view of the mapped file: nothing is copied, so an array
        no one reads costs nothing; those the vocabulary sizes are bounded like the vocabulary."""
        start = self._skip(count * dtype.itemsize, key)
        limit = limits.VOCABULARY_ARRAYS.get(key)
        if limit is not None and count > limit:
            raise self._fail(f"metadata {key} holds {count} values; at most {limit} are read")
        if count == 0:
            return np.empty(0, dtype=dtype)
        values = np.frombuffer(self._map, dtype=dtype, count=count, offset=start)
        values.flags.writeable = False
        return values

    def _value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[vtype][0], key)
        if vtype == _STRING:
            return self._string(key, limits.MAX_METADATA_STRING_BYTES)
        if vtype == _ARRAY:
            etype = self._unpack("<I", f"{key} element type")
            count = self._unpack("<Q", f"{key} element count")
            if etype in _SCALAR_FORMATS:
                return self._numbers(key, _SCALAR_FORMATS[etype][1], count)
            if etype == _STRING:
                return self._strings(key, count)
            raise self._fail(f"{key} has unsupported array element type {etype}")
        raise self._fail(f"{key} has unknown value type {vtype}")

    def _parse(self) -> None:
        if self.size < 24 or self._take(4, "magic") != GGUF_MAGIC:
            raise ModelFileError(self.path, "not a GGUF file (bad magic)")
        version = self._unpack("<I", "version")
        if version not in (2, 3):
            raise self._fail(f"unsupported GGUF version {version}")
        tensor_count = self._unpack("<Q", "tensor count")
        kv_count = self._unpack("<Q", "metadata count")
        # Each entry needs at least a few bytes; this bounds loops on crafted counts.
        if kv_count * 12 > self.size or tensor_count * 24 > self.size:
            raise self._fail(f"counts (tensors={tensor_count}, metadata={kv_count}) exceed the file size")
        if kv_count > limits.MAX_METADATA_KEYS:
            raise self._fail(f"{kv_count} metadata entries; at most {limits.MAX_METADATA_KEYS} are read")
        if tensor_count > limits.MAX_TENSORS:
            raise self._fail(f"{tensor_count} tensors; at most {limits.MAX_TENSORS} are read")
        for _ in range(kv_count):
            key = self._string("metadata key", limits.MAX_METADATA_KEY_BYTES)
            if key in self.metadata:  # which copy counts would be a guess
                raise self._fail(f"metadata key {key} appears twice")
            vtype = self._unpack("<I", f"{key} type")
            self.metadata[key] = self._value(vtype, key)
            self._check_header_size(key)

        infos = []
        names: set[str] = set()
        for _ in range(tensor_count):
            name = self._string("tensor name", limits.MAX_METADATA_KEY_BYTES)
            if name in names:
                raise self._fail(f"tensor {name} appears twice")
            names.add(name)
            n_dims = self._unpack("<I", f"{name} rank")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._fail(f"tensor {name} has rank {n_dims}")
            dims = [self._unpack("<Q", f"{name} dims") for _ in range(n_dims)]
            if 0 in dims:
                raise self._fail(f"tensor {name} has an empty dimension {dims}")
            raw_type = self._unpack("<I", f"{name} type")
            rel_offset = self._unpack("<Q", f"{name} offset")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError as exc:
                raise self._fail(f"tensor {name} has unknown type {raw_type}") from exc
            infos.append((name, dims, qtype, rel_offset))
            self._check_header_size(name)

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int):
            raise self._fail(f"general.alignment must be an integer, not {type(alignment).__name__}")
        if not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
            raise self._fail(f"general.alignment {alignment} is not a power of two up to {MAX_ALIGNMENT}")
        data_start = -(-self._pos // alignment) * alignment
        for name, dims, qtype, rel_offset in infos:
            if rel_offset % alignment:
                raise self._fail(f"tensor {name} offset {rel_offset} is not a multiple of the alignment {alignment}")
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims, dtype=np.float64))
            if dims[0] % block_size:
                raise self._fail(f"tensor {name} row length {dims[0]} is not a multiple of {block_size}")
            nbytes = n_elements // block_size * type_size
            offset = data_start + rel_offset
            if offset + nbytes > self.size:
                raise self._fail(
                    f"tensor {name} ({nbytes} bytes at offset {offset}) runs past the end of the file "
                    f"({self.size} bytes); the file is probably truncated"
                )
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), qtype, offset, nbytes)
        self._check_disjoint()
        end = max((t.offset + t.nbytes for t in self.tensors.values()), default=data_start)
        if self.size - end > limits.MAX_GGUF_TRAILING_BYTES:
            raise self._fail(f"{self.size - end} bytes follow the last tensor; at most "
                             f"{limits.MAX_GGUF_TRAILING_BYTES} may")

    def _check_header_size(self, at: str) -> None:
        if self._pos > limits.MAX_GGUF_HEADER_BYTES:
            raise self._fail(f"the header runs past {limits.MAX_GGUF_HEADER_BYTES} bytes (at {at})")

    def _check_disjoint(self) -> None:
        """Every tensor owns its bytes: overlapping tensors would let a small file describe a huge model."""
        previous: GGUFTensorInfo | None = None
        for info in sorted(self.tensors.values(), key=lambda t: t.offset):
            if previous is not None and info.offset < previous.offset + previous.nbytes:
                raise self._fail(f"tensors {previous.name} and {info.name} overlap in the file")
            previous = info

    # -- tensor access --------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file (rows x bytes-per-row)."""
        info = self.tensors[name]
        flat = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        return flat.reshape(rows, info.nbytes // rows)

    def start_reading(self, targets: dict[str, np.ndarray]) -> TensorRead:
        """Starts reading each named tensor's bytes from the file straight into its target (no mapped
        page is touched, so the file's pages never count as this process's memory); see TensorRead."""
        infos = [self.tensors[name] for name in targets]
        return TensorRead(self.path, list(targets), [info.offset for info in infos], list(targets.values()))

    def _supported_raw(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info.qtype not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise ModelFileError(
                self.path, f"tensor {name} has type {info.qtype.name}, which is not supported (supported: {supported})"
            )
        return self.raw(name)

    def dequantize_array(self, name: str) -> np.ndarray:
        """The tensor as float32 numpy in its torch shape: for the norms and biases of the C step, which
        needs no torch (the float types convert exactly; gguf's dequantizers read the block types)."""
        info, raw = self.tensors[name], self._supported_raw(name)
        if info.qtype in _PLAIN_DTYPES:
            values = raw.view(_PLAIN_DTYPES[info.qtype]).astype(np.float32)
        elif info.qtype == GGMLQuantizationType.BF16:
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = gguf_dequantize(raw, info.qtype)
        return values.reshape(info.shape)

    def dequantize(self, name: str) -> torch.Tensor:
        """The tensor as float32 torch in its torch shape (the header and the raw blocks need no torch).

        Not dequantize_array's values wrapped: this one converts whole dense matrices (--dequantize,
        CUDA), where torch's conversions run on every core and numpy's on one."""
        import torch

        info, raw = self.tensors[name], self._supported_raw(name)
        if info.qtype in _PLAIN_DTYPES:
            values = torch.from_numpy(raw.view(_PLAIN_DTYPES[info.qtype]).copy()).float()
        elif info.qtype == GGMLQuantizationType.BF16:
            values = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).float()
        elif info.qtype == GGMLQuantizationType.Q8_0:
            values = _dequantize_q8_0(raw)
        else:
            values = torch.from_numpy(gguf_dequantize(raw, info.qtype))
        return values.reshape(info.shape)

_Q8_0_BYTES = 34


def _dequantize_q8_0(raw: np.ndarray) -> torch.Tensor:
    """Q8_0 in torch: blocks of one f16 scale and 32 int8 values.

    gguf's numpy version takes ~3 s for the default model's 262k x 640 embedding;
    this takes a fraction of that, and a test checks it against gguf's.
    """
    import torch

    blocks = torch.from_numpy(np.array(raw)).reshape(-1, _Q8_0_BYTES)
    scales = blocks[:, :2].contiguous().view(torch.float16).float()
    quants = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (quants * scales).reshape(raw.shape[0], -1)


def leading_architecture(path: Path, keys: int = 8) -> str | None:
    """general.architecture when it is among a file's first metadata entries (converters write it first), read
    without parsing the header: what kind of model a file holds, before choosing how to load it. None when it
    is not found there (the full parse then names the problem)."""
    try:
        with path.open("rb") as handle:
            if handle.read(4) != GGUF_MAGIC:
                return None
            handle.read(4 + 8 + 8)  # version, tensor count, metadata count
            for _ in range(keys):
                (length,) = struct.unpack("<Q", handle.read(8))
                if length > limits.MAX_METADATA_KEY_BYTES:
                    return None
                key = handle.read(length)
                (vtype,) = struct.unpack("<I", handle.read(4))
                if vtype == _STRING:
                    (size,) = struct.unpack("<Q", handle.read(8))
                    if key == b"general.architecture":
                        return handle.read(min(size, 256)).decode("utf-8", "replace")
                    handle.seek(size, 1)
                elif vtype in _SCALAR_FORMATS:
                    handle.seek(struct.calcsize(_SCALAR_FORMATS[vtype][0]), 1)
                else:  # an array: stop looking
                    return None
    except (OSError, struct.error):
        return None
    return None
