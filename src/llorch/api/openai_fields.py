"""The field types, limits and null policy that OpenAI-shaped request bodies are built from.

Apart from the bodies because other APIs' schemas (Anthropic, Responses, Ollama, llama-server,
tokenize) reuse them too: a strict part, a function name, a token id, the top-logprobs limit,
and "null means the default".
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_TOP_LOGPROBS = 20
TokenId = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    """A request part whose unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


def without_nulls(data: Any) -> Any:
    """A body's fields without those sent as null: an optional field sent as null means its default."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data
