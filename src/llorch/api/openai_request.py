"""OpenAIRequest: the fields and checks that completions and chat completions share.

Sampling, stop strings, penalties, logit bias, streaming options and the output constraint;
the two request bodies (openai_schemas.py) add their prompt or messages on top. The field
policy is openai_schemas.py's.
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llorch.api.fields import (
    MAX_ID_CHARS,
    UINT64_MAX,
    MinP,
    RepetitionPenalty,
    Seed,
    StopString,
    Temperature,
    TopK,
    TopP,
    sampling_params,
    stop_tuple,
)
from llorch.api.openai_fields import Strict, without_nulls
from llorch.api.openai_response_format import ResponseFormat
from llorch.engine.request import IGNORE_EOS, Constraint, SamplingParams

MAX_CHOICES = 8
MAX_LOGIT_BIAS = 1024  # tokens one request may bias


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAIRequest(BaseModel):
    """Parameters shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    # Absent: the served model.
    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = Field(default=None)
    seed: Seed = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # Token id (as a string, as OpenAI has it) -> a bias in [-100, 100] added to its logit before sampling.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(default=None,
                                                                                   max_length=MAX_LOGIT_BIAS)
    # Accepted and ignored: none of them changes the output.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    service_tier: str | None = Field(default=None, max_length=64)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    safety_identifier: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    # Applied: a floor on generated tokens before end-of-generation may come, or none at all.
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    # llorch extras, sent by the openai client through `extra_body`
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    # Constrained output: OpenAI's response_format, or llorch's shorthands `regex` and `grammar` (Lark).
    response_format: ResponseFormat | None = None
    regex: str | None = None
    grammar: str | None = None

    _nulls = model_validator(mode="before")(without_nulls)

    @model_validator(mode="after")
    def _one_constraint(self) -> OpenAIRequest:
        formatted = self.response_format is not None and self.response_format.type != "text"
        given = [name for name, on in (("response_format", formatted), ("regex", self.regex is not None),
                                       ("grammar", self.grammar is not None)) if on]
        if len(given) > 1:
            raise ValueError(f"at most one output constraint per request; got {', '.join(given)}")
        return self

    @model_validator(mode="after")
    def _supported(self) -> OpenAIRequest:
        for key in self.logit_bias or {}:
            if not key.isascii() or not key.isdigit() or len(key) > 9:
                raise ValueError(f"logit_bias: key {key[:40]!r} is not a token id (a non-negative integer)")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 sequences")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than max_tokens ({self.max_tokens})")
        if (self.min_tokens or self.ignore_eos) and self.constraint() is not None:
            raise ValueError("min_tokens: min_tokens and ignore_eos cannot be combined with an output constraint, "
                             "which decides where the output ends")
        return self

    def constraint(self) -> Constraint | None:
        """The output constraint asked for, naming the field it came from (None: free text)."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return Constraint("json_schema", '{"type": "object"}', "response_format")
        if fmt is not None and fmt.json_schema is not None:
            return Constraint("json_schema", json.dumps(fmt.json_schema.schema_), "response_format.json_schema.schema")
        if fmt is not None and fmt.regex is not None:
            return Constraint("regex", fmt.regex, "response_format.regex")
        if fmt is not None and fmt.grammar is not None:
            return Constraint("lark", fmt.grammar, "response_format.grammar")
        if self.regex is not None:
            return Constraint("regex", self.regex, "regex")
        if self.grammar is not None:
            return Constraint("lark", self.grammar, "grammar")
        return None

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, choice: int) -> SamplingParams:
        # Each of n choices gets its own generator: seed, seed+1, ... (reproducible as a set).
        seed = None if self.seed is None else (self.seed + choice) % (UINT64_MAX + 1)
        bias = tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items()))
        return sampling_params(self, seed, presence_penalty=self.presence_penalty,
                               frequency_penalty=self.frequency_penalty, logit_bias=bias,
                               min_tokens=IGNORE_EOS if self.ignore_eos else self.min_tokens)
