"""Grammars for constrained decoding, compiled by llguidance: once per distinct grammar, a matcher per job.

llguidance (a Rust library with no Python dependencies) was chosen over xgrammar after
measuring both on the default model's 262k-token vocabulary: mask time per token was
a few hundredths of a millisecond for either (xgrammar about 5 us, llguidance about
30 us, against a decode step of about 10 ms), but llguidance compiles a JSON schema in
about 1 ms where xgrammar took 90 ms, accepts Lark grammars and regular expressions
natively, and needs neither transformers nor triton at run time.

The library's view of the vocabulary (a token trie) is built once, on the first
constrained request, never on the start-up path: 1.5 s and a few MB
at 262k tokens when it is handed each token's bytes (`token_bytes`), where letting
it parse the tokenizer's JSON again took 3 s and kept a second tokenizer of 134 MB.

Compilation is bounded by the parser limits below (time as lexer fuel, memory as
lexer states and grammar size) and by MAX_GRAMMAR_BYTES on the source; compiled
grammars are cached by content.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper

from llorch.engine.errors import RequestRejected
from llorch.engine.json_bounds import JSON_OPTIONS, bounded
from llorch.engine.request import Constraint
from llorch.weights.tokenizer import SPACE_MARK, Tokenizer

MAX_GRAMMAR_BYTES = 64 * 1024
CACHED_GRAMMARS = 128
# Bounds on one grammar's compilation and per-token work (llguidance's own units: fuel is
# roughly 50k per ms of lexer construction; a lexer state costs 1-2 kB).
LIMITS = dict(initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000, max_lexer_states=100_000,
              max_grammar_size=200_000)


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar and a matcher at its start, copied for every job that uses it."""

    constraint: Constraint
    prototype: LLMatcher

    def matcher(self) -> LLMatcher:
        return self.prototype.deep_copy()


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: LLTokenizer | None = None
        self._build_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        """llguidance's view of our tokenizer, built on first use (seconds at a 262k vocabulary)."""
        with self._build_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(self._tokenizer, self._vocab_size)
            return self._ll_tokenizer

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint compiled for this tokenizer; RequestRejected naming its field when it cannot be."""
        key = (constraint.kind, constraint.source)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = CompiledGrammar(constraint, self._matcher(constraint))
        with self._cache_lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _matcher(self, constraint: Constraint) -> LLMatcher:
        def reject(message: str) -> RequestRejected:
            return RequestRejected(constraint.field, f"a valid {KIND_NAMES[constraint.kind]}", message,
                                   code="invalid_grammar")

        if len(constraint.source.encode()) > MAX_GRAMMAR_BYTES:
            raise reject(f"the {KIND_NAMES[constraint.kind]} is {len(constraint.source.encode())} bytes; "
                         f"at most {MAX_GRAMMAR_BYTES} are accepted")
        try:
            if constraint.kind == "json_schema":
                schema = json.loads(constraint.source)
                if not isinstance(schema, (dict, bool)):
                    raise reject("a JSON schema is an object (or true/false)")
                grammar = LLMatcher.grammar_from_json_schema(bounded(schema), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
            elif constraint.kind == "regex":
                grammar = LLMatcher.grammar_from_regex(constraint.source)
            else:
                grammar = LLMatcher.grammar_from_lark(constraint.source)
        except (ValueError, TypeError) as exc:
            raise reject(str(exc)) from exc
        limits = LLParserLimits(**LIMITS, verbose_errors=False)
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise reject(_one_line(matcher.get_error()))
        # A grammar whose language is empty cannot produce even its first token.
        if not matcher.is_accepting() and not any(matcher.compute_bitmask()):
            raise reject("no output satisfies it")
        if matcher.is_error():
            raise reject(_one_line(matcher.get_error()))
        return matcher


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer:
    eos = sorted(tokenizer.eos_token_ids)
    tokens = token_bytes(tokenizer, vocab_size)
    if tokens is None:  # a tokenizer kind we cannot spell byte by byte: let llguidance read its JSON
        return LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    return LLTokenizer(TokenizerWrapper(_Vocabulary(tokenizer, tokens)), n_vocab=vocab_size, eos_token=eos)


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: every token's bytes, and a way to tokenize text."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes]) -> None:
        self.tokens = tokens
        self.eos_token_id = min(tokenizer.eos_token_ids, default=0)
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._backend = tokenizer.backend

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")
        return self._backend.encode(text, add_special_tokens=False).ids


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes] | None:
    """The bytes each token id stands for, or None for a tokenizer that is neither byte-level BPE
    (GPT-2's byte-to-character alphabet) nor SentencePiece-style (U+2581 for a space, <0xNN> byte tokens)."""
    backend = tokenizer.backend
    decoder = backend.decoder.__getstate__().decode() if backend.decoder is not None else ""
    byte_level = '"ByteLevel"' in decoder
    if not byte_level and SPACE_MARK not in decoder and '"Metaspace"' not in decoder:
        return None
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    from_char = {c: b for b, c in _byte_alphabet().items()}
    tokens = [b""] * vocab_size
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i >= vocab_size:
            continue
        if i in added:
            tokens[i] = added[i].encode()
        elif byte_level:
            tokens[i] = bytes(from_char[c] for c in text) if all(c in from_char for c in text) else text.encode()
        elif i in tokenizer.byte_token_ids:
            tokens[i] = bytes([int(text[3:5], 16)])
        else:
            tokens[i] = text.replace(SPACE_MARK, " ").encode()
    return tokens


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the rest map past U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


KIND_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "lark": "Lark grammar"}


def _one_line(message: str) -> str:
    """The library's message, on one line (a regex error spans several)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:4]) if lines else "the grammar does not compile"
