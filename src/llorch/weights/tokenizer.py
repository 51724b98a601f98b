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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from llorch.errors import ModelFileError

# Bump when the conversion changes, so stale cached tokenizers are not reused.
CONVERTER_VERSION = 1
SPACE_MARK = "\u2581"  # SentencePiece's visible space

# llama.cpp token types (GGUF tokenizer.ggml.token_type)
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_BYTE = 6


def cache_dir() -> Path:
    root = os.environ.get("LLORCH_CACHE_DIR") or Path.home() / ".cache" / "llorch"
    return Path(root)


@dataclass
class Tokenizer:
    """Text <-> token ids for one model, with the ids generation cares about."""

    backend: HFTokenizer
    bos_token_id: int | None
    add_bos: bool
    eos_token_ids: frozenset[int]
    special_ids: frozenset[int]
    byte_token_ids: frozenset[int] = frozenset()  # byte-fallback tokens (<0x00>..<0xFF>)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt ids: the text's tokens, after BOS when the model wants one.

        Text that already spells its special tokens (a rendered chat template) passes
        add_special_tokens=False, so BOS is not doubled.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (special tokens spelled out)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def tokenizer_from_gguf(metadata: dict[str, Any], source: Path) -> Tokenizer:
    """The tokenizer a GGUF file describes, from the on-disk cache when it was built before."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ModelFileError(source, "has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    if kind != "llama":
        raise ModelFileError(source, f"tokenizer kind {kind!r} is not supported yet (supported: 'llama')")
    token_types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(token_types) != len(tokens):
        raise ModelFileError(source, "tokenizer token_type and tokens have different lengths")
    architecture = str(metadata.get("general.architecture", ""))

    key = _vocab_key(metadata, tokens, token_types, architecture)
    cached = cache_dir() / "tokenizers" / f"{key}.json"
    if cached.is_file():
        try:
            backend = HFTokenizer.from_file(str(cached))
        except Exception:  # a damaged cache entry is rebuilt, never trusted
            backend = None
    else:
        backend = None
    if backend is None:
        backend = _build_spm_bpe(tokens, token_types, metadata, architecture)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        backend.save(str(tmp))
        tmp.replace(cached)

    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos_ids = {int(metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if k in metadata}
    # Gemma ends a chat turn with <end_of_turn>; llama.cpp treats it as end of generation too.
    if architecture.startswith("gemma") and "<end_of_turn>" in tokens:
        eos_ids.add(tokens.index("<end_of_turn>"))
    special = frozenset(i for i, t in enumerate(token_types) if t == TOKEN_CONTROL)
    return Tokenizer(
        backend=backend,
        bos_token_id=int(bos) if bos is not None else None,
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", True)),
        eos_token_ids=frozenset(eos_ids),
        special_ids=special,
        byte_token_ids=frozenset(i for i, t in enumerate(token_types) if t == TOKEN_BYTE),
    )


def _vocab_key(metadata: dict[str, Any], tokens: list[str], types: list[int], architecture: str) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([CONVERTER_VERSION, architecture], ensure_ascii=False).encode())
    digest.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(bytes(t & 0xFF for t in types))
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is not None:
        digest.update(memoryview(scores).tobytes())
    return digest.hexdigest()[:32]


def _build_spm_bpe(
    tokens: list[str], token_types: list[int], metadata: dict[str, Any], architecture: str
) -> HFTokenizer:
    """A SentencePiece BPE vocabulary (byte fallback, "▁" for spaces) as a `tokenizers` BPE.

    GGUF files of this kind carry no merge list, so merges are recovered from the
    vocabulary: every way to split a token into two tokens is a merge, ranked by how
    early SentencePiece would merge it (the merged token's priority).
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
    merges = _merges_from_vocab(vocab, priority)

    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    backend = HFTokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPACE_MARK)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # Control tokens (<bos>, <start_of_turn>, ...) are matched whole in the text and are
    # special; user-defined ones (HTML tags, newline runs) are matched whole but are text.
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True)
         for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False)
         for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_USER_DEFINED and t in vocab]
    )
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if bos_id is not None and metadata.get("tokenizer.ggml.add_bos_token", True):
        bos = tokens[int(bos_id)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    return backend


def _merges_from_vocab(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """All (left, right) splits of each token whose halves are tokens, best merge first.

    Ties are ordered by longer left part, then longer right part, then vocabulary
    order of the merged token and of its halves, matching the reference conversion.
    """
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for order, (merged, score) in enumerate(priority.items()):
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), order, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
