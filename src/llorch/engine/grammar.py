"""Grammars for constrained decoding, compiled by llguidance: once per distinct grammar, a matcher per job.

llguidance (a Rust library with no Python dependencies) was chosen over xgrammar after
measuring both on the default model's 262k-token vocabulary: mask time per token was
a few hundredths of a millisecond for either (xgrammar about 5 us, llguidance about
30 us, against a decode step of about 10 ms), but llguidance compiles a JSON schema in
about 1 ms where xgrammar took 90 ms, accepts Lark grammars and regular expressions
natively, and needs neither transformers nor triton at run time.

The library's view of the vocabulary (a token trie, and sub-tries for JSON strings) is
built once, on the first constrained request (a request thread), never on the start-up
path: 1-2 s and about 120 MB resident at 262k tokens when it is handed each token's bytes
(vocabulary.py), where letting it parse the tokenizer's JSON again took 3 s and kept a
second tokenizer of 134 MB. llguidance's constructor holds the GIL throughout (about 1 s
of it), so /health can wait that long, once.

A grammar is a program, and a short one can be expensive: `b{1000}{1000}` is 13 bytes and
forces a million bytes, one lexer state each (300 MB and seconds, before these bounds).
So every compilation is bounded:
- by the parser limits below, which llguidance enforces itself (lexer fuel, lexer states,
  grammar size), at compile time and at every later step;
- by a probe before the job starts: the first PROBE_STEPS masks are computed and a token
  consumed after each, so a grammar that breaks a limit in its first tokens (where the
  library notices forced bytes running out of fuel) is a 400 naming its field, not an
  error in the middle of a stream;
- by the size of each regex it holds, counted from its text (regex_size): a nested repetition
  behind a prefix gets past the probe, which never generates that far;
- one grammar compiles at a time, so a burst of expensive grammars never adds up, and
  the memory a refused one took goes back to the system at once.
Compiled grammars are cached by content, within CACHE_BYTES of the memory each took to
compile (the growth of the allocator's bytes in use while it compiled, all threads
counted: an estimate) and at most CACHED_GRAMMARS of them.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from llorch.engine.errors import RequestRejected
from llorch.engine.json_bounds import JSON_OPTIONS, bounded
from llorch.engine.regex_size import lark_patterns, positions, schema_patterns
from llorch.engine.request import Constraint
from llorch.engine.vocabulary import ll_tokenizer
from llorch.memory import heap_bytes, release_freed_memory
from llorch.weights.tokenizer import Tokenizer

MAX_GRAMMAR_BYTES = 64 * 1024
CACHED_GRAMMARS = 128
CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse, by the memory each took to compile
# Bounds on one grammar's compilation and per-token work, in llguidance's own units. Lexer fuel
# is spent building regex derivatives, and a grammar that forces bytes turns it into memory:
# about 150 bytes a unit (with 2M, `b{1000}{1000}` took 330 MB and 1.5 s). So the fuel a grammar
# gets grows with its own size: a 63 KB JSON schema of 260 nested objects needed between 300k
# and 600k; a padded 64 KiB bomb at the cap peaks about 160 MB. A lexer state costs 1-2 kB.
LIMITS = dict(step_lexer_fuel=200_000, max_lexer_states=50_000, max_grammar_size=200_000)
BASE_LEXER_FUEL = 100_000
LEXER_FUEL_PER_BYTE = 10  # of the compiled grammar's text (a JSON schema's, after json_bounds spells it out)
MAX_LEXER_FUEL = 800_000
PROBE_STEPS = 4
MAX_REGEX_POSITIONS = LIMITS["max_lexer_states"]  # a lexer state per position is what a counted repeat costs


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar and a matcher at its start, copied for every job that uses it.

    `nbytes` is the memory compiling it took, as measured (the lexer's tables, the parser).
    """

    constraint: Constraint
    prototype: LLMatcher
    nbytes: int = 0

    def matcher(self) -> LLMatcher:
        return self.prototype.deep_copy()


class Grammars:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_bytes: int = CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self._cache_budget = cache_bytes
        self._vocab_size = vocab_size
        self._ll_tokenizer: LLTokenizer | None = None
        self._build_lock = threading.Lock()
        self._compile_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._cached_bytes = 0

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        """llguidance's view of our tokenizer, built on first use (seconds at a 262k vocabulary)."""
        with self._build_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(self._tokenizer, self._vocab_size)
            return self._ll_tokenizer

    def prepare(self) -> None:
        """Build the vocabulary view now (--grammar-at-start), so no request waits for it."""
        _ = self.ll_tokenizer

    @property
    def vocabulary_ready(self) -> bool:
        """Whether the vocabulary view has been built (on first use, or by `prepare`)."""
        return self._ll_tokenizer is not None

    @property
    def cached_bytes(self) -> int:
        """The memory the cached grammars took to compile, as measured."""
        with self._cache_lock:
            return self._cached_bytes

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint compiled for this tokenizer; RequestRejected naming its field when it cannot be."""
        key = (constraint.kind, constraint.source)
        compiled = self._lookup(key)
        if compiled is not None:
            return compiled
        grammar = grammar_text(constraint)  # a refusal that needs no vocabulary builds none (ll_tokenizer)
        tokenizer = self.ll_tokenizer
        with self._compile_lock:  # one at a time: each is measured alone, and expensive ones never stack up
            compiled = self._lookup(key)  # compiled for another request while this one waited
            if compiled is not None:
                return compiled
            before = heap_bytes()
            try:
                matcher = self._matcher(constraint, grammar, tokenizer)
            except RequestRejected:
                release_freed_memory()  # what the refused grammar took goes back to the system now
                raise
            compiled = CompiledGrammar(constraint, matcher, max(heap_bytes() - before, 0))
            self._store(key, compiled)
        return compiled

    def _lookup(self, key: tuple[str, str]) -> CompiledGrammar | None:
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def _store(self, key: tuple[str, str], compiled: CompiledGrammar) -> None:
        """Keep `compiled`, evicting the least recently used grammars beyond the byte budget or CACHED_GRAMMARS.

        A grammar bigger than the whole budget is not kept: its memory goes with its last job.
        """
        if compiled.nbytes > self._cache_budget:
            return
        with self._cache_lock:
            self._cache[key] = compiled
            self._cached_bytes += compiled.nbytes
            while len(self._cache) > CACHED_GRAMMARS or self._cached_bytes > self._cache_budget:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.nbytes

    def _matcher(self, constraint: Constraint, grammar: str, tokenizer: LLTokenizer) -> LLMatcher:
        limits = LLParserLimits(**LIMITS, initial_lexer_fuel=lexer_fuel(grammar), verbose_errors=False)
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        problem = probe(matcher, self._tokenizer.eos_token_ids)
        if problem is not None:
            del matcher  # its memory goes now, not when the exception's traceback does
            raise refusal(constraint, problem if problem == NO_OUTPUT else explained(KIND_NAMES[constraint.kind],
                                                                                      problem))
        return matcher


def refusal(constraint: Constraint, message: str) -> RequestRejected:
    return RequestRejected(constraint.field, f"a valid {KIND_NAMES[constraint.kind]}", message, code="invalid_grammar")


def grammar_text(constraint: Constraint) -> str:
    """The constraint as the grammar engine's text, after every check that needs no vocabulary."""
    kind = KIND_NAMES[constraint.kind]

    def reject(message: str) -> RequestRejected:
        return refusal(constraint, message)

    size = len(constraint.source.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise reject(f"the {kind} is {size} bytes; at most {MAX_GRAMMAR_BYTES} are accepted")
    try:
        if constraint.kind == "json_schema":
            schema = json.loads(constraint.source)
            if not isinstance(schema, (dict, bool)):
                raise reject("a JSON schema is an object (or true/false)")
            check_regexes(schema_patterns(schema), kind, reject)
            return LLMatcher.grammar_from_json_schema(bounded(schema), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if constraint.kind == "regex":
            check_regexes([constraint.source], kind, reject)
            return LLMatcher.grammar_from_regex(constraint.source)
        check_regexes(lark_patterns(constraint.source), kind, reject)
        return LLMatcher.grammar_from_lark(constraint.source)
    except (ValueError, TypeError) as exc:
        raise reject(engine_message(str(exc))) from exc


NO_OUTPUT = "no output satisfies it"


def check_regexes(patterns: Iterable[str], kind: str, reject: Callable[[str], RequestRejected]) -> None:
    """Refuse a regex whose counted repetitions expand past the lexer's state limit: the engine would
    only notice once generation reached them, behind a prefix mid-stream (regex_size)."""
    for pattern in patterns:
        count = positions(pattern)
        if count > MAX_REGEX_POSITIONS:
            shown = f"{pattern[:40]}..." if len(pattern) > 40 else pattern
            raise reject(f"the {kind} is too complex for the grammar limits: the regular expression {shown!r} "
                         f"expands to {count} positions, at most {MAX_REGEX_POSITIONS}; nested repetition such "
                         "as a{1000}{1000} multiplies")


def lexer_fuel(grammar: str) -> int:
    """The lexer fuel a grammar gets to compile: bounded by its own size, and by MAX_LEXER_FUEL."""
    return min(BASE_LEXER_FUEL + LEXER_FUEL_PER_BYTE * len(grammar), MAX_LEXER_FUEL)


def probe(matcher: LLMatcher, eos: Iterable[int]) -> str | None:
    """Why `matcher` cannot serve a job, or None. Its first PROBE_STEPS masks are computed and one
    allowed token consumed after each (the lowest id that does not end the output), then it is
    reset: a grammar that breaks a limit in its first tokens breaks it here.

    The steps matter: `b{1000}{1000}` forces a million bytes, and the library notices it ran out
    of fuel only when a token is consumed. The lexer states the probe builds stay in the lexer
    the jobs share: it is also a warm-up.
    """
    for step in range(PROBE_STEPS):
        if matcher.is_error() or (step > 0 and matcher.is_stopped()):
            break
        mask = bytearray(matcher.compute_bitmask())
        if matcher.is_error():
            break
        if step == 0 and not matcher.is_accepting() and not any(mask):
            return NO_OUTPUT  # its language is empty: not even a first token
        for token_id in eos:
            if token_id // 8 < len(mask):
                mask[token_id // 8] &= ~(1 << token_id % 8) & 0xFF
        token_id = first_set_bit(mask)
        if token_id is None:
            break
        matcher.consume_token(token_id)
    if matcher.is_error():
        return engine_message(matcher.get_error())
    matcher.reset()
    return None


def explained(kind: str, message: str) -> str:
    """The engine's message, and what it means when it names one of the limits."""
    if any(word in message.lower() for word in ("too many", "fuel", "too big", "limit")):
        return (f"the {kind} is too complex for the grammar limits ({message}); nested repetition such as "
                "a{1000}{1000} multiplies")
    return message


def first_set_bit(mask: bytes | bytearray) -> int | None:
    """The lowest token id a bitmask allows (one bit per id, least significant bit first), or None."""
    zeros = len(mask) - len(bytes(mask).lstrip(b"\x00"))
    if zeros == len(mask):
        return None
    byte = mask[zeros]
    return zeros * 8 + (byte & -byte).bit_length() - 1


KIND_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "lark": "Lark grammar"}
_MARKUP = re.compile(r"<[a-z][a-z-]*/>")  # the engine's tags, such as <non-verbose/>


def engine_message(message: str) -> str:
    """The grammar engine's message on one line, without its markup (a regex error spans several lines)."""
    lines = [line.strip() for line in _MARKUP.sub("", message).strip().splitlines() if line.strip()]
    return " ".join(lines[:4]) if lines else "the grammar does not compile"
