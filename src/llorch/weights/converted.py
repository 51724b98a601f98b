"""What a GGUF file converts into, cached on disk and keyed by the file's sha256.

The digest itself is remembered on disk by the file's stat stamp, so a warm start reads
nothing of the file to find its entry.

A cold start parses the GGUF header (a 262k-token vocabulary is ~0.3 s), builds a
tokenizer and repacks every quantized tensor. A warm start reads instead, from
`<cache>/converted/<sha256>-v<version>/`:
- meta.json: the model's name, config, chat template and tokenizer ids;
- tokenizer.json: the tokenizer, loaded by `tokenizers` directly (tokenizer_file), when the
  loader asks: after the weights have started reading, since the parse holds Python's lock;
- tokenizer.spm.npz: the same tokenizer as the C tokenizer's tables (native_tokenizer), for a
  SentencePiece vocabulary it reproduces: loaded instead of the JSON, in a tenth of the time.
- weights-<kernels>.bin / .json: the C step's matrices as its kernels read them (weights.weight_image).
Every file is written to a temporary name and renamed, so a crash or a concurrent
worker never leaves a half-written entry; a damaged entry is rebuilt, never trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from llorch.cache import cache_dir
from llorch.models.config import ModelConfig
from llorch.weights.native_tokenizer import NativeSpm, tables_beside
from llorch.weights.tokenizer import Tokenizer
from llorch.weights.tokenizer_file import save_tokenizer

log = logging.getLogger("llorch.weights")

# Bump whenever a conversion changes what it produces (config fields, repacking, names).
CONVERSION_VERSION = 4  # 3: tokenizer.json's merges as strings; 4: the C tokenizer's tables beside it

_known_digests: dict[tuple[object, ...], str] = {}


def _stamp(path: Path) -> tuple[object, ...]:
    """What changes whenever the file's bytes may have: the ctime moves on every write, and on
    every change of the mtime too, so a file rewritten with its old mtime restored still misses."""
    info = path.stat()
    return str(path.resolve()), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def _memo_file(stamp: tuple[object, ...]) -> Path:
    return cache_dir() / "digests" / f"{hashlib.sha256(str(stamp[0]).encode()).hexdigest()[:32]}.json"


def known_digest(path: Path) -> str | None:
    """The file's sha256 when it was computed (or checked) before and the file has not changed since:
    from this process, else from the on-disk memo, which spares each start a read of the whole file."""
    stamp = _stamp(path)
    if stamp in _known_digests:
        return _known_digests[stamp]
    try:
        memo = json.loads(_memo_file(stamp).read_text(encoding="utf-8"))
        if memo["stamp"] == json.loads(json.dumps(stamp)) and isinstance(memo["sha256"], str):
            _known_digests[stamp] = memo["sha256"]
            return memo["sha256"]
    except (OSError, ValueError, KeyError, TypeError):  # absent, damaged or another file's: hash again
        pass
    return None


def remember_digest(path: Path, sha256: str) -> None:
    """Record a digest computed or verified for the file as it is now, in this process and on disk."""
    stamp = _stamp(path)
    _known_digests[stamp] = sha256
    memo = _memo_file(stamp)
    temporary = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps({"stamp": stamp, "sha256": sha256}), encoding="utf-8")
        os.replace(temporary, memo)
    except OSError as exc:  # a read-only cache costs a hash per start, never the start
        log.warning("cannot write the digest memo", extra={"path": str(memo), "reason": str(exc)})
        temporary.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    digest = known_digest(path)
    if digest is None:
        with path.open("rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        remember_digest(path, digest)
    return digest


@dataclasses.dataclass(frozen=True)
class ConvertedMeta:
    name: str
    config: ModelConfig
    chat_template: str | None
    # The tokenizer built by a conversion, or parsed from the cache when called (most of a
    # second, holding Python's lock: the loader starts the weights reading first).
    tokenizer: Callable[[], Tokenizer]
    tensors: list[list[Any]]  # the GGUF file's tensor table (GGUFFile.tensor_table)


class ConversionCache:
    def __init__(self, sha256: str) -> None:
        self.directory = cache_dir() / "converted" / f"{sha256}-v{CONVERSION_VERSION}"

    def _write(self, name: str, write: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / name
        temporary = target.with_name(f".{name}.{os.getpid()}.tmp")
        try:
            write(temporary)
            os.replace(temporary, target)
        except OSError as exc:  # a read-only or full cache costs speed, never the start
            log.warning("cannot write the conversion cache", extra={"path": str(target), "reason": str(exc)})
            temporary.unlink(missing_ok=True)

    def read_meta(self) -> ConvertedMeta | None:
        try:
            meta = json.loads((self.directory / "meta.json").read_text(encoding="utf-8"))
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()}
            ids = meta["tokenizer"]
            ids = (ids["bos"], frozenset(ids["eos"]), frozenset(ids["special"]), frozenset(ids["bytes"]))
            return ConvertedMeta(meta["name"], ModelConfig(**fields), meta["chat_template"],
                                 lambda: self._read_tokenizer(*ids), meta["tensors"])
        except FileNotFoundError:
            return None
        except Exception as exc:  # damaged or from another version of the code: convert again
            log.warning("ignoring a damaged conversion cache entry", extra={"path": str(self.directory),
                                                                             "reason": repr(exc)})
            return None

    def _read_tokenizer(self, bos: int | None, eos: frozenset[int], special: frozenset[int],
                        byte_tokens: frozenset[int]) -> Tokenizer:
        """The cached tokenizer; any exception means a damaged entry (the caller rebuilds it)."""
        saved = self.directory / "tokenizer.json"
        backend = NativeSpm.load(saved) or HFTokenizer.from_file(str(saved))
        return Tokenizer(backend=backend, bos_token_id=bos, eos_token_ids=eos, special_ids=special,
                         byte_token_ids=byte_tokens)

    def write_meta(self, meta: ConvertedMeta) -> None:
        tok = meta.tokenizer()
        document = {
            "name": meta.name,
            "config": dataclasses.asdict(meta.config),
            "chat_template": meta.chat_template,
            "tensors": meta.tensors,
            "tokenizer": {"bos": tok.bos_token_id, "eos": sorted(tok.eos_token_ids),
                          "special": sorted(tok.special_ids), "bytes": sorted(tok.byte_token_ids)},
        }
        # The tokenizer first: meta.json is what marks the entry as present. Serializing a 262k
        # vocabulary takes most of a second; the tokenizer cache's file of it is copied instead.
        if tok.saved is not None and tok.saved.is_file():
            if tables_beside(tok.saved).is_file():
                self._write(tables_beside(Path("tokenizer.json")).name,
                            lambda path: shutil.copyfile(tables_beside(tok.saved), path))
            self._write("tokenizer.json", lambda path: shutil.copyfile(tok.saved, path))
        else:
            self._write("tokenizer.json", lambda path: save_tokenizer(tok.backend, path))
        self._write("meta.json", lambda path: path.write_text(json.dumps(document), encoding="utf-8"))
