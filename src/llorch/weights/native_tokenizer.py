"""A SentencePiece-style vocabulary served by our C tokenizer (kernels/csrc/tokenizer.c).

The `tokenizers` object built from a GGUF vocabulary (weights/tokenizer.py) stays the
definition; this is the same tokenizer in flat arrays, saved beside its JSON in the cache.
A warm start loads the arrays in tens of milliseconds where parsing the JSON took 0.8 s
and ~90 MB at 262k tokens. What the C code does not cover (pooling's pair encodings, say)
is answered by the library's object, parsed from the cached JSON on first use.

Only vocabularies whose every part the C code reproduces get tables (`spm_tables` says
None otherwise): every byte has its <0xNN> token, added tokens are vocabulary tokens
matched whole and raw, and the pipeline is the one weights/tokenizer.py builds.
"""

from __future__ import annotations

import ctypes
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as HFTokenizer

from llorch.kernels.build import KernelUnavailable, library

TABLES_VERSION = 1
SPACE_MARK = "\u2581"
_FLAG_HOLE, _FLAG_SPECIAL = 1, 2  # as tokenizer.c numbers them


def spm_decoder(prepend: bool) -> decoders.Decoder:
    """A SentencePiece vocabulary's decoder: U+2581 read as a space, byte tokens joined into characters, and the
    dummy prefix's space taken off again where the encoder puts one (`prepend`). llorch_tok_decode is this."""
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence([*steps, decoders.Strip(content=" ", left=1)] if prepend else steps)


def tables_beside(saved: Path) -> Path:
    """Where the tables of the tokenizer saved as `saved` (its JSON) are kept."""
    return saved.with_suffix(".spm.npz")


@dataclass(frozen=True)
class SpmTables:
    """The arrays tokenizer.c reads, as the cache keeps them."""

    offsets: np.ndarray  # int64, n + 1: token i is blob[offsets[i]:offsets[i + 1]] (UTF-8)
    blob: np.ndarray  # uint8
    flags: np.ndarray  # uint8 per id: no token (a hole), special
    bytevals: np.ndarray  # int16 per id: the byte a "<0xNN>" token decodes to, else -1
    byte_tokens: np.ndarray  # int32: ids spelled <0xNN>, which tokenizer.Tokenizer.byte_token_ids lists
    merges: np.ndarray  # int32 (m, 3): left, right, merged, best first
    added: np.ndarray  # int32: ids matched whole in the text before it is split
    prepend: bool  # SentencePiece's dummy prefix (and the decoder's strip of it)
    bos: int  # the id encode(add_special_tokens=True) puts first, or -1

    @property
    def special_ids(self) -> frozenset[int]:
        """Added tokens that decode(skip_special_tokens=True) leaves out."""
        return frozenset(int(i) for i in self.added if self.flags[i] & _FLAG_SPECIAL)

    def save(self, saved: Path) -> None:
        """Beside `saved`, the library's JSON of the same tokenizer, which the tables are tied to by its checksum:
        a damaged JSON is caught as the tables load, not at the first request that needs the library."""
        target = tables_beside(saved)
        tmp = target.with_name(f"{target.stem}.tmp{os.getpid()}.npz")
        meta = np.array([TABLES_VERSION, int(self.prepend), self.bos, _checksum(saved)], dtype=np.int64)
        np.savez(tmp, meta=meta, offsets=self.offsets, blob=self.blob, flags=self.flags, bytevals=self.bytevals,
                 byte_tokens=self.byte_tokens, merges=self.merges, added=self.added)
        tmp.replace(target)

    @classmethod
    def read(cls, saved: Path) -> SpmTables | None:
        """The tables saved beside `saved`, or None: none there, of another version, damaged, or not of this JSON
        (then the caller parses the JSON, or rebuilds it when it is damaged: never trusted)."""
        try:
            with np.load(tables_beside(saved), allow_pickle=False) as arrays:
                meta = arrays["meta"]
                if meta.shape != (4,) or int(meta[0]) != TABLES_VERSION or int(meta[3]) != _checksum(saved):
                    return None
                tables = cls(offsets=arrays["offsets"], blob=arrays["blob"], flags=arrays["flags"],
                             bytevals=arrays["bytevals"], byte_tokens=arrays["byte_tokens"], merges=arrays["merges"],
                             added=arrays["added"], prepend=bool(meta[1]), bos=int(meta[2]))
        except Exception:  # unreadable, truncated, not an archive: damaged
            return None
        n = len(tables.flags)
        valid = (tables.offsets.dtype == np.int64 and tables.offsets.shape == (n + 1,) and tables.offsets[0] == 0
                 and np.all(np.diff(tables.offsets) >= 0) and tables.offsets[-1] == len(tables.blob)
                 and tables.blob.dtype == np.uint8 and tables.flags.dtype == np.uint8
                 and tables.bytevals.dtype == np.int16 and tables.bytevals.shape == (n,)
                 and tables.merges.dtype == np.int32 and tables.merges.ndim == 2 and tables.merges.shape[1] == 3
                 and tables.added.dtype == np.int32 and tables.byte_tokens.dtype == np.int32
                 and all(len(a) == 0 or (a.min() >= 0 and a.max() < n)
                         for a in (tables.merges.ravel(), tables.added, tables.byte_tokens)))
        return tables if valid else None


def _checksum(file: Path) -> int:
    """CRC-32 of a file: damage, not tampering, is what it is for (17 MB in a few ms, without Python's lock)."""
    return zlib.crc32(file.read_bytes())


def _byte_value(text: str) -> int:
    """The byte `tokenizers`' byte-fallback decoder reads in a token's text, or -1 (Rust's u8 parse: a
    leading '+' is allowed)."""
    if len(text.encode()) != 6 or not text.startswith("<0x") or not text.endswith(">"):
        return -1
    digits = text[3:5]
    if digits[0] == "+":
        digits = digits[1:]
    if not digits or any(c not in "0123456789abcdefABCDEF" for c in digits):
        return -1
    return int(digits, 16)


def spm_tables(backend: Any, vocab: dict[str, int], merges: np.ndarray, size: int, prepend: bool,
               bos: int | None, byte_tokens: set[int]) -> SpmTables | None:
    """The C tokenizer's tables for `backend`, a BPE built by weights/tokenizer.py from `vocab` (text -> id, over
    ids 0..size-1) and `merges` ((left, right, merged) ids, best first); None when some part of it is outside
    what the C code reproduces."""
    texts: list[str | None] = [None] * size
    for text, index in vocab.items():
        texts[index] = text
    if any(f"<0x{b:02X}>" not in vocab for b in range(256)):
        return None  # a character outside the vocabulary would need the unknown token
    added, special = [], []
    for index, token in backend.get_added_tokens_decoder().items():
        if (index >= size or texts[index] != token.content or token.normalized or token.lstrip or token.rstrip
                or token.single_word or not token.content):
            return None
        added.append(index)
        if token.special:
            special.append(index)
    encoded = [(t or "").encode() for t in texts]
    offsets = np.zeros(size + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    flags = np.full(size, _FLAG_HOLE, dtype=np.uint8)
    flags[np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))] = 0
    flags[np.array(special, dtype=np.int64)] |= _FLAG_SPECIAL
    bytevals = np.full(size, -1, dtype=np.int16)
    for index, text in enumerate(texts):
        if text is not None and text.startswith("<0x"):  # what the byte-fallback decoder reads; cheap to skip
            bytevals[index] = _byte_value(text.replace(SPACE_MARK, " "))
    return SpmTables(
        offsets=offsets, blob=np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), flags=flags,
        bytevals=bytevals, byte_tokens=np.array(sorted(byte_tokens), dtype=np.int32),
        merges=np.ascontiguousarray(merges, dtype=np.int32).reshape(-1, 3),
        added=np.array(sorted(added), dtype=np.int32), prepend=prepend, bos=-1 if bos is None else bos)


@dataclass(frozen=True)
class Encoded:
    """What encode gives: the ids (the library's Encoding has more; the C path gives only these)."""

    ids: list[int]


class NativeSpm:
    """The C tokenizer behind the `tokenizers.Tokenizer` methods the worker calls; the rest go to the
    library's object, parsed from `saved` (the cached JSON) when first asked for."""

    def __init__(self, tables: SpmTables, saved: Path) -> None:
        self.tables = tables
        self.saved = saved
        self._lib = library()
        t = tables
        handle = self._lib.llorch_tok_new(
            len(t.flags), t.offsets.ctypes.data, t.blob.ctypes.data, t.flags.ctypes.data, t.bytevals.ctypes.data,
            t.merges.ctypes.data, len(t.merges), t.added.ctypes.data, len(t.added), int(t.prepend))
        if not handle:
            raise MemoryError("the tokenizer's tables")
        self._handle = ctypes.c_void_p(handle)
        self._library_lock = threading.Lock()
        self._library: Any = None

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle:
            self._lib.llorch_tok_free(handle)

    @classmethod
    def load(cls, saved: Path) -> NativeSpm | None:
        """The tables saved beside `saved` behind the C code, or None (no tables, or no C kernels here)."""
        tables = SpmTables.read(saved) if tables_beside(saved).is_file() else None
        if tables is None:
            return None
        try:
            return cls(tables, saved)
        except KernelUnavailable:
            return None

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoded:
        data = text.encode()  # a lone surrogate raises here, as the library refuses it
        out = np.empty(2 * len(data) + 2, dtype=np.int32)
        count = self._lib.llorch_tok_encode(self._handle, data, len(data), out.ctypes.data)
        if count < 0:
            raise MemoryError("tokenizing the text")
        ids = out[:count].tolist()
        if add_special_tokens and self.tables.bos >= 0:
            ids.insert(0, self.tables.bos)
        return Encoded(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Built with ctypes, not numpy: the detokenizer decodes a few ids every generated token, and
        # numpy's array set-up and range checks cost more than the decode (two ids: 7.6 -> 3.3 µs warm,
        # several times both once a step's weight stream has emptied the caches).
        ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        if ids and (min(ids) < 0 or max(ids) > 0xFFFFFFFF):
            raise OverflowError("token ids are unsigned 32-bit integers")
        array = (ctypes.c_int64 * len(ids))(*ids)
        cap = 16 * len(ids) + 16
        while True:
            out = ctypes.create_string_buffer(cap)
            length = self._lib.llorch_tok_decode(self._handle, ctypes.addressof(array), len(ids),
                                                 int(skip_special_tokens), ctypes.addressof(out), cap)
            if length < 0:
                raise MemoryError("decoding token ids")
            if length <= cap:
                break
            cap = length
        text = ctypes.string_at(out, length).decode()
        return text[1:] if self.tables.prepend and text.startswith(" ") else text

    def token_to_id(self, text: str) -> int | None:
        data = text.encode("utf-8", "surrogatepass")
        found = self._lib.llorch_tok_lookup(self._handle, data, len(data))
        return None if found < 0 else int(found)

    def id_to_token(self, token_id: int) -> str | None:
        t = self.tables
        if not 0 <= token_id < len(t.flags) or t.flags[token_id] & _FLAG_HOLE:
            return None
        return t.blob[t.offsets[token_id]:t.offsets[token_id + 1]].tobytes().decode()

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        """Every token's text and id (added tokens are vocabulary tokens here, so the flag changes nothing)."""
        t, blob = self.tables, self.tables.blob.tobytes()
        bounds = t.offsets.tolist()
        return {blob[bounds[i]:bounds[i + 1]].decode(): i
                for i in range(len(t.flags)) if not t.flags[i] & _FLAG_HOLE}

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return int(np.count_nonzero((self.tables.flags & _FLAG_HOLE) == 0))

    def to_str(self) -> str:
        return self.saved.read_text(encoding="utf-8")

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return {int(i): AddedToken(self.id_to_token(int(i)), special=bool(self.tables.flags[i] & _FLAG_SPECIAL),
                                   normalized=False) for i in self.tables.added}

    @property
    def decoder(self) -> decoders.Decoder:
        """The library's decoder that this one reproduces (the grammar's vocabulary reads its kind)."""
        return spm_decoder(self.tables.prepend)

    @property
    def library_tokenizer(self) -> Any:
        """The library's object for this vocabulary, parsed from the cached JSON on first use (pooling's pair
        encodings and anything else the C code does not answer)."""
        with self._library_lock:
            if self._library is None:
                self._library = HFTokenizer.from_file(str(self.saved))
            return self._library

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("tables", "saved"):
            raise AttributeError(name)
        return getattr(self.library_tokenizer, name)
