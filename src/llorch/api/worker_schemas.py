"""Request bodies of the worker API (DESIGN.md: /execute, /cancel), validated by pydantic, and its 400 shape."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llorch.api.fields import (
    MAX_PROMPT_CHARS,
    JobId,
    MinP,
    RepetitionPenalty,
    Seed,
    StopString,
    Temperature,
    TopK,
    TopP,
    sampling_params,
)
from llorch.engine.request import Constraint, GenerationRequest


class ExecuteRequest(BaseModel):
    # Strict: "5" is not an int and true is not a number; unknown fields are errors.
    model_config = ConfigDict(extra="forbid", strict=True)

    job_id: JobId
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    max_tokens: int = Field(ge=1, le=2048)
    temperature: Temperature = 1.0
    seed: Seed = None
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: list[StopString] = Field(default_factory=list, max_length=4)
    # Constrained output (at most one): a JSON schema the text must satisfy, or a Lark grammar it must match.
    json_schema: dict[str, Any] | None = None
    grammar: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_constraint(self) -> ExecuteRequest:
        if self.json_schema is not None and self.grammar is not None:
            raise ValueError("json_schema and grammar cannot both be given")
        return self

    def to_generation_request(self) -> GenerationRequest:
        sampling = sampling_params(self, self.seed)
        constraint = None
        if self.json_schema is not None:
            constraint = Constraint("json_schema", json.dumps(self.json_schema), "json_schema")
        elif self.grammar is not None:
            constraint = Constraint("lark", self.grammar, "grammar")
        return GenerationRequest(self.job_id, self.prompt, self.max_tokens, sampling, tuple(self.stop),
                                 constraint=constraint)


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    job_id: JobId


# pydantic error type -> the constraint we name, given the error's context.
_CONSTRAINTS = {
    "missing": lambda ctx: "required",
    "extra_forbidden": lambda ctx: "unknown field",
    "greater_than_equal": lambda ctx: f">= {ctx['ge']}",
    "less_than_equal": lambda ctx: f"<= {ctx['le']}",
    "string_too_short": lambda ctx: f"length >= {ctx['min_length']}",
    "string_too_long": lambda ctx: f"length <= {ctx['max_length']}",
    "too_short": lambda ctx: f"at least {ctx['min_length']} items",
    "too_long": lambda ctx: f"at most {ctx['max_length']} items",
    "model_type": lambda ctx: "JSON object",
}


def field_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """Every violation, as {field, constraint, message, value?}."""
    errors = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(part) for part in err["loc"]) or "body"
        kind = err["type"]
        describe = _CONSTRAINTS.get(kind)
        constraint = describe(err.get("ctx", {})) if describe else kind.removesuffix("_type") + " type"
        entry: dict[str, Any] = {"field": loc, "constraint": constraint, "message": err["msg"]}
        if kind != "missing" and _is_small_json_value(err.get("input")):
            entry["value"] = err["input"]
        errors.append(entry)
    return errors


MAX_ECHOED_CHARS = 200  # an offending value is echoed back only when short: a 1 MiB one would be amplified


def _is_small_json_value(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_ECHOED_CHARS
    if isinstance(value, list):
        return len(json.dumps(value, default=str)) <= MAX_ECHOED_CHARS
    return isinstance(value, (int, float, bool)) or value is None
