"""The body of llama-server's POST /completion, its defaults, and the samplers it may name.

Apart from the other llama-server bodies (llama_server_schemas.py) because it is most of them:
every sampler setting llama-server has, each applied, ignored or refused. The field policy is
the OpenAI API's (openai_schemas.py): what cannot change the output is accepted and ignored
(`cache_prompt`, `id_slot`, `n_keep`, `model`, the settings of samplers that are off); what
changes it is applied; a sampler this worker does not have is accepted only at its "off" value,
and anything else is a 400 naming the field. README's table says which field is which.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any

from llguidance.gbnf_to_lark import gbnf_to_lark
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llorch.api.fields import UINT64_MAX, MinP, RepetitionPenalty, StopString, TopP, stop_tuple
from llorch.api.llama_server_schemas import one_prompt
from llorch.api.openai_fields import MAX_TOP_LOGPROBS, without_nulls
from llorch.engine.errors import RequestRejected
from llorch.engine.request import IGNORE_EOS, Constraint, SamplingParams

# llama-server's defaults for /completion, used when a request leaves a field out.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
DEFAULT_REPEAT_LAST_N = 64
MAX_STOPS = 16
MAX_GBNF_CHARS = 64 * 1024  # bounds the conversion; the engine bounds the grammar it compiles
RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama-server draws a seed for either (the second is its LLAMA_DEFAULT_SEED)
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]

# `samplers` by name (with llama-server's other spellings) or by letter, as its parser reads them.
SAMPLER_NAMES = {"penalties": "penalties", "dry": "dry", "top_n_sigma": "top_n_sigma", "top-n-sigma": "top_n_sigma",
                 "top_k": "top_k", "top-k": "top_k", "typ_p": "typ_p", "typ-p": "typ_p", "typ": "typ_p",
                 "typical_p": "typ_p", "typical-p": "typ_p", "typical": "typ_p", "top_p": "top_p",
                 "top-p": "top_p", "nucleus": "top_p", "min_p": "min_p", "min-p": "min_p", "xtc": "xtc",
                 "temperature": "temperature", "temp": "temperature", "infill": "infill"}
SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                   "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill"}
# What this worker's sampler does, in its fixed order (penalties, temperature, then the filters).
LLORCH_SAMPLERS = ("penalties", "temperature", "top_k", "top_p", "min_p")
FILTERS = ("top_k", "top_p", "min_p")


class LlamaCompletionRequest(BaseModel):
    """The body of llama-server's POST /completion."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[int | str]
    # Applied.
    n_predict: int | None = Field(default=None, ge=-1)  # -1: until an end-of-generation token or the context ends
    max_tokens: int | None = Field(default=None, ge=-1)  # llama-server's other name for n_predict
    stream: bool = False
    stop: StopString | list[StopString] | None = None
    temperature: float = Field(default=DEFAULT_TEMPERATURE, le=2.0)  # 0 or less: greedy
    top_k: int = DEFAULT_TOP_K  # 0 or less: off
    top_p: TopP = DEFAULT_TOP_P
    min_p: MinP = DEFAULT_MIN_P
    seed: int = Field(default=-1, ge=-1, le=UINT64_MAX)
    repeat_penalty: RepetitionPenalty = 1.0
    repeat_last_n: int = Field(default=DEFAULT_REPEAT_LAST_N, ge=-1)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    ignore_eos: bool = False
    n_probs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    return_tokens: bool = False
    grammar: str | None = None  # GBNF, llama.cpp's grammar format
    json_schema: dict[str, Any] | None = None
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    samplers: list[str] | str | None = None
    timings_per_token: bool = False
    response_fields: list[str] | None = None
    # Accepted and ignored: the model is the served one; caching and slots do not change the output here
    # (this worker never shifts the context, so n_keep and n_discard never come into play).
    model: str | None = None
    cache_prompt: bool = True
    id_slot: int = Field(default=-1, ge=-1)
    n_keep: int = Field(default=0, ge=-1)
    n_discard: int = Field(default=0, ge=0)
    n_cache_reuse: int = Field(default=0, ge=0)
    return_progress: bool = False
    sse_ping_interval: float | None = None
    # Settings of samplers this worker does not have: no effect while the sampler is off (below).
    dynatemp_exponent: float = 1.0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] | None = None
    xtc_threshold: float = 0.1
    # Accepted only at their "off" value.
    dynatemp_range: float = 0.0
    typical_p: float = 1.0
    tfs_z: float = 1.0
    mirostat: int = 0
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    top_n_sigma: float = -1.0
    min_keep: int = 0
    n_indent: int = 0
    n_cmpl: int = 1
    t_max_predict_ms: int = 0
    post_sampling_probs: bool = False
    lora: list[Any] | None = None

    _nulls = model_validator(mode="before")(without_nulls)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        return one_prompt(value)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        return value

    @model_validator(mode="after")
    def _off_unless_supported(self) -> LlamaCompletionRequest:
        off = [("dynatemp_range", self.dynatemp_range == 0, "dynamic temperature", "0"),
               ("typical_p", self.typical_p == 1, "locally typical sampling", "1.0"),
               ("tfs_z", self.tfs_z == 1, "tail-free sampling", "1.0"),
               ("mirostat", self.mirostat == 0, "mirostat sampling", "0"),
               ("dry_multiplier", self.dry_multiplier == 0, "DRY sampling", "0"),
               ("xtc_probability", self.xtc_probability == 0, "XTC sampling", "0"),
               ("top_n_sigma", self.top_n_sigma <= 0, "top-n-sigma sampling", "-1"),
               ("min_keep", self.min_keep in (0, 1), "a minimum of tokens kept by the filters", "0"),
               ("n_indent", self.n_indent == 0, "an indentation limit", "0"),
               ("n_cmpl", self.n_cmpl == 1, "several completions per prompt", "1"),
               ("t_max_predict_ms", self.t_max_predict_ms == 0, "a time limit on generation", "0"),
               ("post_sampling_probs", not self.post_sampling_probs, "probabilities after sampling", "false"),
               ("lora", not self.lora, "LoRA adapters", "[]")]
        for name, is_off, what, value in off:
            if not is_off:
                raise ValueError(f"{name}: {what} is not supported by this worker (only {value}, off)")
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("grammar: give grammar or json_schema, not both")
        if self.ignore_eos and (self.grammar is not None or self.json_schema is not None):
            raise ValueError("ignore_eos: cannot be combined with grammar or json_schema, which decide where the "
                             "output ends")
        penalized = self.repeat_penalty != 1 or self.presence_penalty or self.frequency_penalty
        if penalized and self.repeat_last_n not in (-1, 0):
            raise ValueError(f"repeat_last_n: penalties over the last {self.repeat_last_n} tokens are not supported; "
                             "this worker's penalties cover the whole context: send repeat_last_n -1 (or 0 to turn "
                             "the penalties off)")
        self.bias()
        self.enabled_samplers()
        return self

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs: [[id, bias], ...] or {"id": bias}; false bans the token."""
        if self.logit_bias is None:
            return ()
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        found: dict[int, float] = {}
        for pair in pairs:
            if len(pair) != 2:
                raise ValueError("logit_bias: each entry is a [token id, bias] pair")
            token, value = pair
            if isinstance(token, str) and token.isascii() and token.isdigit() and len(token) <= 9:
                token = int(token)
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias: {str(token)[:40]!r} is not a token id (biasing text is not supported "
                                 "here; give token ids)")
            if value is False:
                found[token] = float("-inf")
            elif isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias: the bias of token {token} must be a number in [-100, 100] or false")
            else:
                found[token] = float(value)
        return tuple(sorted(found.items()))

    def enabled_samplers(self) -> frozenset[str]:
        """The samplers this worker runs: all of them, or those `samplers` lists (their order is this worker's)."""
        if self.samplers is None:
            return frozenset(LLORCH_SAMPLERS)
        raw = list(self.samplers) if isinstance(self.samplers, str) else self.samplers
        table = SAMPLER_LETTERS if isinstance(self.samplers, str) else SAMPLER_NAMES
        unknown = [name for name in raw if name.lower() not in table]
        if unknown:
            raise ValueError(f"samplers: unknown sampler {unknown[0][:40]!r}")
        names = [table[name.lower()] for name in raw]
        if "infill" in names:
            raise ValueError("samplers: the infill sampler is not supported")
        filters = [name for name in names if name in FILTERS]
        if filters != sorted(set(filters), key=FILTERS.index):
            raise ValueError("samplers: this worker applies top_k, top_p and min_p in that order, once each")
        if "penalties" in names and filters and names.index("penalties") > names.index(filters[0]):
            raise ValueError("samplers: this worker applies the penalties before top_k, top_p and min_p")
        return frozenset(names) & frozenset(LLORCH_SAMPLERS)

    @property
    def predict(self) -> int:
        """n_predict (or max_tokens); -1: no limit."""
        return self.n_predict if self.n_predict is not None else self.max_tokens if self.max_tokens is not None else -1

    @property
    def engine_max_tokens(self) -> int | None:
        return None if self.predict < 0 else self.predict

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)

    def seed_to_use(self) -> int:
        """The seed asked for, or one drawn here for a random one (so the answer can report it)."""
        return secrets.randbelow(RANDOM_SEEDS[1]) if self.seed in RANDOM_SEEDS else self.seed

    def sampling(self, seed: int) -> SamplingParams:
        on = self.enabled_samplers()
        penalties = "penalties" in on and self.repeat_last_n != 0
        return SamplingParams(
            temperature=max(self.temperature, 0.0) if "temperature" in on else 1.0,
            top_k=max(self.top_k, 0) if "top_k" in on else 0,
            top_p=self.top_p if "top_p" in on else 1.0, min_p=self.min_p if "min_p" in on else 0.0,
            repetition_penalty=self.repeat_penalty if penalties else 1.0,
            presence_penalty=self.presence_penalty if penalties else 0.0,
            frequency_penalty=self.frequency_penalty if penalties else 0.0,
            seed=seed, logit_bias=self.bias(), min_tokens=IGNORE_EOS if self.ignore_eos else 0)


    @property
    def logprobs(self) -> int | None:
        """Top alternatives per token for the engine to report; 0 still reports each chosen token, whose id a
        stream's chunks and `return_tokens` carry (None: neither is needed, nothing is computed)."""
        if self.n_probs:
            return self.n_probs
        return 0 if self.stream or self.return_tokens else None

    def constraint(self) -> Constraint | None:
        """A JSON schema, or the GBNF grammar converted to the Lark form the engine compiles (CPU work)."""
        if self.json_schema is not None:
            return Constraint("json_schema", json.dumps(self.json_schema), "json_schema")
        if self.grammar is None:
            return None
        if len(self.grammar) > MAX_GBNF_CHARS:
            raise RequestRejected("grammar", f"<= {MAX_GBNF_CHARS} characters",
                                  f"the grammar is {len(self.grammar)} characters; at most {MAX_GBNF_CHARS}")
        try:
            return Constraint("lark", gbnf_to_lark(self.grammar), "grammar")
        except Exception as exc:  # the converter raises plain Exceptions (and RecursionError when nested deeply)
            raise RequestRejected("grammar", "a GBNF grammar",
                                  f"not a GBNF grammar this worker can read: {str(exc)[:300]}") from exc

    def settings(self, seed: int, n_ctx: int, model: str) -> dict[str, Any]:
        """The settings the job runs with, in llama-server's names (samplers: those on, in this worker's order)."""
        sampling = self.sampling(seed)
        penalties = sampling.repetition_penalty != 1 or sampling.presence_penalty or sampling.frequency_penalty
        samplers = [name for name, on in (
            ("penalties", penalties), ("temperature", "temperature" in self.enabled_samplers()),
            ("top_k", sampling.top_k > 0), ("top_p", sampling.top_p < 1), ("min_p", sampling.min_p > 0)) if on]
        return {"n_ctx": n_ctx, "model": model, "n_predict": self.predict, "seed": seed,
                "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                "min_p": sampling.min_p, "repeat_last_n": self.repeat_last_n,
                "repeat_penalty": sampling.repetition_penalty, "presence_penalty": sampling.presence_penalty,
                "frequency_penalty": sampling.frequency_penalty, "dynatemp_range": 0.0, "typical_p": 1.0,
                "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "stop": list(self.stop_sequences),
                "max_tokens": self.predict, "n_keep": self.n_keep, "ignore_eos": self.ignore_eos,
                "stream": self.stream, "n_probs": self.n_probs, "min_keep": self.min_keep,
                "grammar": self.grammar or "", "samplers": samplers, "timings_per_token": self.timings_per_token,
                "post_sampling_probs": False, "lora": []}
