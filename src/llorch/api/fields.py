"""The field types and limits every API's request bodies share: sampling ranges, stop strings, seeds,
the length of a prompt and of an id. One declaration each, so the worker API, OpenAI's, Anthropic's,
Ollama's and llama-server's bodies cannot drift apart."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StringConstraints

from llorch.engine.request import SamplingParams

UINT64_MAX = (1 << 64) - 1

StopString = Annotated[str, StringConstraints(min_length=1, max_length=100)]

# Sampling rules shared by the worker API and the OpenAI API: one declaration each.
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Seed = Annotated[int | None, Field(ge=0, le=UINT64_MAX)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Field(ge=0.0, le=2.0)]


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    """A request's stop sequences (one string, a list, or none) as the engine takes them."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def sampling_params(body: Any, seed: int | None, **extra: Any) -> SamplingParams:
    """SamplingParams from a validated request carrying the shared sampling fields."""
    return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                          repetition_penalty=body.repetition_penalty, seed=seed, **extra)


MAX_PROMPT_CHARS = 32768  # one prompt's text, or one chat message's: checked before anything tokenizes it
MAX_ID_CHARS = 256  # job ids and model names: they appear in every event and log line
JobId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS)]
