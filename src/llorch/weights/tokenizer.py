"""Tokenizers: built from GGUF vocabulary metadata as `tokenizers` objects, cached on disk.

A GGUF file carries its vocabulary as arrays (tokens, scores, token types). We turn
that into a `tokenizers.Tokenizer` that encodes and decodes exactly like the
reference implementation, and cache the result as tokenizer.json keyed by a hash
of the vocabulary, so only the first start pays for the conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from llorch.cache import cache_dir
from llorch.errors import ModelFileError
from llorch.kernels.build import KernelUnavailable, loaded
from llorch.weights.limits import (
    DEFAULT_JSON_BYTES,
    JSON_FILE_BYTES,
    MAX_TOKEN_CHARS,
    MAX_TOKENIZER_JSON_BYTES,
    MAX_TOKENIZER_STRINGS,
    MAX_VOCAB,
    require_regular_file,
)
from llorch.weights.merges import merges_from_vocab
from llorch.weights.native_tokenizer import NativeSpm, SpmTables, spm_decoder, spm_tables
from llorch.weights.tokenizer_file import save_tokenizer

# Bump when the conversion changes, so stale cached tokenizers are not reused.
CONVERTER_VERSION = 5  # 4: merges saved as strings (tokenizer_file); 5: the C tokenizer's tables beside
SPACE_MARK = "\u2581"  # SentencePiece's visible space
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte-fallback tokens

# GGUF vocabulary kinds: SentencePiece-style BPE with scores, and byte-level BPE with merges.
GGUF_TOKENIZER_KINDS = ("llama", "gpt2")

# How byte-level vocabularies split text before BPE, by the name GGUF gives it in
# tokenizer.ggml.pre. The patterns are those the models were trained with.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BPE_PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None,  # GPT-2's own pattern, built into the ByteLevel pre-tokenizer
    "gpt-2": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Vocabularies whose reference tokenizer applies Unicode NFC first.
_NFC_PRE_TOKENIZERS = {"qwen2", "deepseek-r1-qwen"}

# llama.cpp token types (GGUF tokenizer.ggml.token_type)
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_BYTE = 6


class TokenizationError(ValueError):
    """The model's tokenizer failed on a text (a pre-tokenizer regex past its backtracking limit)."""


# What a failure inside the Rust tokenizer can raise: its errors, and its panics, which pyo3
# reports as PanicException, a BaseException (so `except Exception` would let it through).
_NOT_FAILURES = (KeyboardInterrupt, SystemExit, GeneratorExit)


@dataclass
class Tokenizer:
    """Text <-> token ids for one model, with the ids generation cares about."""

    backend: HFTokenizer | NativeSpm
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    special_ids: frozenset[int]
    byte_token_ids: frozenset[int] = frozenset()  # byte-fallback tokens (<0x00>..<0xFF>)
    saved: Path | None = None  # a file holding the backend as save_tokenizer wrote it: copied, not serialized again

    @classmethod
    def around(cls, backend: HFTokenizer, bos_token_id: int | None, eos_token_ids: set[int]) -> Tokenizer:
        """A Tokenizer for `backend`: special and byte-fallback ids are read off its vocabulary."""
        added = backend.get_added_tokens_decoder()
        return cls(
            backend=backend,
            bos_token_id=bos_token_id,
            eos_token_ids=frozenset(eos_token_ids),
            special_ids=frozenset(i for i, token in added.items() if token.special),
            byte_token_ids=frozenset(i for t, i in backend.get_vocab().items() if BYTE_TOKEN.fullmatch(t)),
        )

    @property
    def library(self) -> HFTokenizer:
        """The `tokenizers` object itself (behind the C tokenizer, parsed from its cached JSON on first use)."""
        return self.backend.library_tokenizer if isinstance(self.backend, NativeSpm) else self.backend

    def has_token(self, text: str) -> bool:
        """Whether `text` is one token of the vocabulary (asked of the backend: building its whole
        vocabulary as a dict takes 0.2 s and 30 MB at 262k tokens)."""
        return self.backend.token_to_id(text) is not None

    @property
    def leading_bos(self) -> int | None:
        """BOS when the model starts every prompt with it (its tokenizer adds it), else None."""
        if self.bos_token_id is None:
            return None
        return self.bos_token_id if self.backend.encode("a", add_special_tokens=True).ids[:1] == [
            self.bos_token_id] else None

    @property
    def eos_token_id(self) -> int | None:
        """The model's end-of-sequence token: the lowest end-of-generation id (end-of-turn ids come later)."""
        return min(self.eos_token_ids, default=None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt ids: the text's tokens, after BOS when the model wants one.

        Text that already spells its special tokens (a rendered chat template) passes
        add_special_tokens=False, so BOS is not doubled.
        """
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except _NOT_FAILURES:
            raise
        except BaseException as exc:
            raise TokenizationError(f"the model's tokenizer failed on this text ({str(exc)[:200]})") from exc

    def encode_for_pooling(self, text: str, pair: str | None, limit: int | None) -> tuple[list[int], list[int], int]:
        """An embedding input, or a (query, document) pair, with the model's special tokens and segment ids:
        (ids, type ids, the length before any cut). With a `limit`, the text (a pair's document) is cut so that
        the whole, special tokens included, fits it, as sentence-transformers cuts."""
        library = self.library
        try:
            first = library.encode(text, add_special_tokens=False)
            second = library.encode(pair, add_special_tokens=False) if pair is not None else None
            specials = library.num_special_tokens_to_add(is_pair=second is not None)
            length = len(first.ids) + (len(second.ids) if second is not None else 0) + specials
            if limit is not None and length > limit:
                cut = second if second is not None else first
                room = limit - specials - (len(first.ids) if second is not None else 0)
                if room < 0:
                    raise TokenizationError(f"the query alone is longer than the {limit} tokens a pair may have")
                cut.truncate(room)
            whole = library.post_process(first, second, add_special_tokens=True)
        except _NOT_FAILURES:
            raise
        except TokenizationError:
            raise
        except BaseException as exc:
            raise TokenizationError(f"the model's tokenizer failed on this text ({str(exc)[:200]})") from exc
        return whole.ids, whole.type_ids, length

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (special tokens spelled out)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)


def tokenizer_from_gguf(metadata: dict[str, Any], source: Path) -> Tokenizer:
    """The tokenizer a GGUF file describes, from the on-disk cache when it was built before."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ModelFileError(source, "has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    if kind not in GGUF_TOKENIZER_KINDS:
        raise ModelFileError(
            source, f"tokenizer kind {kind!r} is not supported (supported: {', '.join(GGUF_TOKENIZER_KINDS)})"
        )
    check_vocabulary(tokens, source)
    # The arrays that parallel the vocabulary are counted before a value of theirs is converted.
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in metadata and len(metadata[key]) != len(tokens):
            raise ModelFileError(source, f"{key} holds {len(metadata[key])} values for {len(tokens)} tokens")
    token_types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    architecture = str(metadata.get("general.architecture", ""))

    key = _vocab_key(metadata, tokens, token_types, architecture)
    cached = cache_dir() / "tokenizers" / f"{key}.json"
    # The C tokenizer's tables, for a SentencePiece vocabulary it reproduces, are saved beside the JSON.
    backend: HFTokenizer | NativeSpm | None = NativeSpm.load(cached) if cached.is_file() else None
    tables = backend.tables if backend is not None else None  # what the special and byte ids are read from
    if backend is None and cached.is_file():
        try:
            backend = HFTokenizer.from_file(str(cached))
        except Exception:  # a damaged cache entry is rebuilt, never trusted
            backend = None
    if backend is None:
        merges = None
        if kind == "gpt2":
            backend = _build_byte_level_bpe(tokens, token_types, metadata, source)
        else:
            backend, merges, tables = _build_spm_bpe(tokens, token_types, metadata, architecture)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        save_tokenizer(backend, tmp, merges)
        tmp.replace(cached)
        if tables is not None:
            tables.save(cached)
        if merges is not None:  # the backend above has no merges: the saved vocabulary, as a warm start reads it
            backend = _spm_backend(tables, cached)

    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos_ids = {int(metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if k in metadata}
    # Gemma ends a chat turn with <end_of_turn>; llama.cpp treats it as end of generation too.
    if architecture.startswith("gemma") and "<end_of_turn>" in tokens:
        eos_ids.add(tokens.index("<end_of_turn>"))
    bos_id = int(bos) if bos is not None else None
    if tables is not None:  # the ids are in the tables: no 0.2 s walk of the library's vocabulary
        return Tokenizer(backend=backend, bos_token_id=bos_id, eos_token_ids=frozenset(eos_ids),
                         special_ids=tables.special_ids, byte_token_ids=frozenset(tables.byte_tokens.tolist()),
                         saved=cached)
    return replace(Tokenizer.around(backend, bos_id, eos_ids), saved=cached)


def check_vocabulary(tokens: Any, source: Path) -> None:
    """A GGUF vocabulary: a list of at most MAX_VOCAB strings of at most MAX_TOKEN_CHARS each."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelFileError(source, "tokenizer.ggml.tokens must be an array of strings")
    if not 0 < len(tokens) <= MAX_VOCAB:
        raise ModelFileError(source, f"tokenizer.ggml.tokens holds {len(tokens)} tokens; it must hold 1 to {MAX_VOCAB}")
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i]))
    if len(tokens[longest]) > MAX_TOKEN_CHARS:
        raise ModelFileError(source, f"token {longest} is {len(tokens[longest])} characters long; "
                             f"at most {MAX_TOKEN_CHARS} are allowed")


def tokenizer_from_hf_dir(directory: Path, bos_token_id: int | None, eos_token_ids: set[int]) -> Tokenizer:
    """A Hugging Face directory's tokenizer.json; special-token names come from tokenizer_config.json."""
    file = directory / "tokenizer.json"
    if not file.exists():
        hint = " (only tokenizer.model: llorch needs the fast tokenizer.json)" if (
            directory / "tokenizer.model").exists() else ""
        raise ModelFileError(directory, f"has no tokenizer.json{hint}")
    check_tokenizer_file(file)
    try:
        backend = HFTokenizer.from_file(str(file))
    except Exception as exc:
        raise ModelFileError(file, f"is not a valid tokenizer ({exc})") from exc
    # A tokenizer.json may pad or truncate every text to a fixed length (sentence-transformers' files do):
    # lengths are the worker's to check, and a silent cut would change a prompt.
    backend.no_padding()
    backend.no_truncation()
    # Before the vocabulary becomes Python objects (Tokenizer.around reads it whole).
    size = backend.get_vocab_size(with_added_tokens=True)
    if size > MAX_VOCAB:
        raise ModelFileError(file, f"holds {size} tokens; at most {MAX_VOCAB} are allowed")
    settings = read_json_object(directory / "tokenizer_config.json", required=False)
    vocab = backend.get_vocab()

    def token_id(field: str) -> int | None:
        value = settings.get(field)
        if isinstance(value, dict):  # {"content": "<s>", ...}
            value = value.get("content")
        return vocab.get(value) if isinstance(value, str) else None

    if bos_token_id is None:
        bos_token_id = token_id("bos_token")
    eos = token_id("eos_token")
    if eos is not None:
        eos_token_ids = {*eos_token_ids, eos}
    return Tokenizer.around(backend, bos_token_id, eos_token_ids)


def check_tokenizer_file(file: Path) -> None:
    """A tokenizer.json `tokenizers` can build within bounded memory: its size, and the strings it holds
    (tokens, merges, added tokens: what the built tokenizer's size follows), bounded before it is parsed.

    Each JSON string takes two quote characters and a quote inside one is escaped as a third, so half the
    quotes bound the strings from above, counted at memchr speed.
    """
    size = require_regular_file(file)
    if size > MAX_TOKENIZER_JSON_BYTES:
        raise ModelFileError(file, f"is {size} bytes; a tokenizer may have at most {MAX_TOKENIZER_JSON_BYTES}")
    quotes = 0
    try:
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                quotes += chunk.count(b'"')
    except OSError as exc:
        raise ModelFileError(file, f"cannot be read ({exc.strerror})") from exc
    if quotes > 2 * MAX_TOKENIZER_STRINGS:
        raise ModelFileError(file, f"holds up to {quotes // 2} strings; a tokenizer of at most {MAX_VOCAB} tokens "
                             f"may hold {MAX_TOKENIZER_STRINGS} (tokens, merges and added tokens)")


def read_json_object(file: Path, required: bool = True) -> dict[str, Any]:
    """A JSON object from a model directory; a broken one is a ModelFileError naming the file.

    Each file's size is bounded by what it holds (limits.JSON_FILE_BYTES) before it is parsed.
    """
    if not file.exists():
        if required:
            raise ModelFileError(file, "is missing")
        return {}
    size = require_regular_file(file)
    limit = JSON_FILE_BYTES.get(file.name, DEFAULT_JSON_BYTES)
    if size > limit:
        raise ModelFileError(file, f"is {size} bytes; a {file.name} may have at most {limit}")
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(file, f"is not valid JSON ({exc})") from exc
    except RecursionError as exc:  # nested deeper than the parser's stack allows
        raise ModelFileError(file, "nests too deeply to be a model's JSON file") from exc
    if not isinstance(value, dict):
        raise ModelFileError(file, "does not hold a JSON object")
    return value


def _vocab_key(metadata: dict[str, Any], tokens: list[str], types: list[int], architecture: str) -> str:
    digest = hashlib.sha256()
    # Everything the conversion reads goes into the key.
    settings = [metadata.get(f"tokenizer.ggml.{k}") for k in (
        "model", "pre", "bos_token_id", "unknown_token_id", "add_bos_token", "add_space_prefix")]
    digest.update(json.dumps([CONVERTER_VERSION, architecture, settings], ensure_ascii=False, default=str).encode())
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        digest.update("\n".join(merges).encode("utf-8", "surrogatepass"))
    digest.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(bytes(t & 0xFF for t in types))
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is not None:
        digest.update(memoryview(scores).tobytes())
    return digest.hexdigest()[:32]


def _spm_backend(tables: SpmTables | None, saved: Path) -> HFTokenizer | NativeSpm:
    """A SentencePiece vocabulary just saved: the C tokenizer over its tables, or `tokenizers` reading the JSON
    where the C code does not reproduce it (or is not built here)."""
    if tables is not None:
        try:
            return NativeSpm(tables, saved)
        except KernelUnavailable:
            pass
    return HFTokenizer.from_file(str(saved))


def _build_spm_bpe(
    tokens: list[str], token_types: list[int], metadata: dict[str, Any], architecture: str
) -> tuple[HFTokenizer, list[tuple[str, str]], SpmTables | None]:
    """A SentencePiece BPE vocabulary (byte fallback, "▁" for spaces) as a `tokenizers` BPE, built without its
    merges, which come back beside it for the saved JSON (save_tokenizer), and the C tokenizer's tables.

    GGUF files of this kind carry no merge list, so merges are recovered from the
    vocabulary: every way to split a token into two tokens is a merge, ranked by how
    early SentencePiece would merge it (the merged token's priority). Why not hand them to the
    BPE: converting Gemma 3's 515k pairs into the library's object, and decoding them again
    from its JSON to save them, took about 1 s of a first start that then tokenizes with the
    C code (or the saved JSON).
    """
    if architecture.startswith("gemma"):
        # Gemma's files spell whitespace-run tokens with real spaces while its text
        # normalizer produces "▁", and its scores do not follow merge order: the vocab
        # position does. Both as the reference implementation reads these files.
        vocab_tokens = [SPACE_MARK * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority = {token: -index for index, token in enumerate(vocab_tokens)}
    else:
        vocab_tokens = list(tokens)
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise ValueError("a SentencePiece vocabulary needs tokenizer.ggml.scores")
        priority = {token: float(s) for token, s in zip(vocab_tokens, scores, strict=True)}
    vocab = {token: index for index, token in enumerate(vocab_tokens)}
    merges, merge_ids = merges_from_vocab(vocab, priority, loaded())

    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    backend = HFTokenizer(BPE(vocab=vocab, merges=[], unk_token=unk, fuse_unk=True, byte_fallback=True))
    prepend = not architecture.startswith("gemma") and bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    if architecture.startswith("gemma"):
        backend.normalizer = normalizers.Replace(" ", SPACE_MARK)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        # SentencePiece puts a space before the text (its dummy prefix) unless the file says
        # not to, even when the text already starts with one; the decoder takes it off again.
        steps = [normalizers.Replace(" ", SPACE_MARK)]
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), *steps] if prepend else steps)
    backend.decoder = spm_decoder(prepend)
    _add_vocab_specials(backend, tokens, token_types, vocab)
    bos = _add_bos_processor(backend, tokens, metadata, default=True)
    byte_tokens = {i for t, i in vocab.items() if BYTE_TOKEN.fullmatch(t)}
    return backend, merges, spm_tables(backend, vocab, merge_ids, len(tokens), prepend, bos, byte_tokens)


def _build_byte_level_bpe(
    tokens: list[str], token_types: list[int], metadata: dict[str, Any], source: Path
) -> HFTokenizer:
    """A byte-level BPE vocabulary (GPT-2 style: Llama 3, Qwen2) with its merges and pre-tokenizer."""
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelFileError(source, "byte-level BPE tokenizer has no tokenizer.ggml.merges")
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in BPE_PRE_TOKENIZERS:
        raise ModelFileError(
            source, f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))})"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise ModelFileError(source, f"merge {merge!r} is not two tokens")
        pairs.append((left, right))
    # Llama 3's vocabulary takes a whole word that is itself a token before trying merges.
    backend = HFTokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=pre in ("llama-bpe", "llama3")))
    split = BPE_PRE_TOKENIZERS[pre]
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _NFC_PRE_TOKENIZERS:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    _add_vocab_specials(backend, tokens, token_types, vocab)
    _add_bos_processor(backend, tokens, metadata, default=False)
    return backend


def _add_vocab_specials(backend: HFTokenizer, tokens: list[str], token_types: list[int],
                        vocab: dict[str, int]) -> None:
    """Control tokens (<bos>, <|eot_id|>, ...) are matched whole in the text and are special;
    user-defined ones (HTML tags, <think>) are matched whole but are text."""
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True)
         for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False)
         for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_USER_DEFINED and t in vocab]
    )


def _add_bos_processor(backend: HFTokenizer, tokens: list[str], metadata: dict[str, Any],
                       default: bool) -> int | None:
    """BOS before the prompt when the file asks for it (SentencePiece vocabularies do by default): its id."""
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if bos_id is None or not metadata.get("tokenizer.ggml.add_bos_token", default):
        return None
    bos = tokens[int(bos_id)]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
    )
    return int(bos_id)
