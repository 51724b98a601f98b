"""What a GGUF file converts into, cached on disk and keyed by the file's sha256.

A cold start parses the GGUF header (a 262k-token vocabulary is ~0.3 s), builds a
tokenizer and repacks every quantized tensor. A warm start reads instead, from
`<cache>/converted/<sha256>-v<version>/`:
- meta.json: the model's name, config, chat template and tokenizer ids;
- tokenizer.json: the tokenizer, loaded by `tokenizers` directly.
The weights need no cache: the CPU worker views them in place in the mapped file.
Every file is written to a temporary name and renamed, so a crash or a concurrent
worker never leaves a half-written entry; a damaged entry is rebuilt, never trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from llorch.cache import cache_dir
from llorch.models.config import ModelConfig
from llorch.weights.tokenizer import Tokenizer

log = logging.getLogger("llorch.weights")

# Bump whenever a conversion changes what it produces (config fields, repacking, names).
CONVERSION_VERSION = 2

_known_digests: dict[tuple[str, int, int, int], str] = {}


def _stamp(path: Path) -> tuple[str, int, int, int]:
    info = path.stat()
    return str(path.resolve()), info.st_size, info.st_mtime_ns, info.st_ino


def remember_digest(path: Path, sha256: str) -> None:
    """Record a digest already verified elsewhere (the default model is checked on assembly)."""
    _known_digests[_stamp(path)] = sha256


def file_sha256(path: Path) -> str:
    stamp = _stamp(path)
    if stamp not in _known_digests:
        with path.open("rb") as handle:
            _known_digests[stamp] = hashlib.file_digest(handle, "sha256").hexdigest()
    return _known_digests[stamp]


@dataclasses.dataclass(frozen=True)
class ConvertedMeta:
    name: str
    config: ModelConfig
    chat_template: str | None
    tokenizer: Tokenizer
    tensors: list[list[Any]]  # the GGUF file's tensor table (GGUFFile.tensor_table)


class ConversionCache:
    def __init__(self, model_file: Path) -> None:
        self.directory = cache_dir() / "converted" / f"{file_sha256(model_file)}-v{CONVERSION_VERSION}"

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
            backend = HFTokenizer.from_file(str(self.directory / "tokenizer.json"))
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()}
            ids = meta["tokenizer"]
            tokenizer = Tokenizer(backend=backend, bos_token_id=ids["bos"], eos_token_ids=frozenset(ids["eos"]),
                                  special_ids=frozenset(ids["special"]), byte_token_ids=frozenset(ids["bytes"]))
            return ConvertedMeta(meta["name"], ModelConfig(**fields), meta["chat_template"], tokenizer,
                                 meta["tensors"])
        except FileNotFoundError:
            return None
        except Exception as exc:  # damaged or from another version of the code: convert again
            log.warning("ignoring a damaged conversion cache entry", extra={"path": str(self.directory),
                                                                             "reason": repr(exc)})
            return None

    def write_meta(self, meta: ConvertedMeta) -> None:
        tok = meta.tokenizer
        document = {
            "name": meta.name,
            "config": dataclasses.asdict(meta.config),
            "chat_template": meta.chat_template,
            "tensors": meta.tensors,
            "tokenizer": {"bos": tok.bos_token_id, "eos": sorted(tok.eos_token_ids),
                          "special": sorted(tok.special_ids), "bytes": sorted(tok.byte_token_ids)},
        }
        # The tokenizer first: meta.json is what marks the entry as present.
        self._write("tokenizer.json", lambda path: tok.backend.save(str(path)))
        self._write("meta.json", lambda path: path.write_text(json.dumps(document), encoding="utf-8"))
