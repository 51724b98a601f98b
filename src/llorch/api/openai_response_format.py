"""OpenAI's `response_format`: the structured-output constraint a request may ask for.

Apart from the request bodies: it is one part of them, with checks of its own.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llorch.api.openai_fields import FunctionName, Strict


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's response_format; "regex" and "grammar" (Lark) are llorch's extra constraint types."""

    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> ResponseFormat:
        needed = {"json_schema": self.json_schema, "regex": self.regex, "grammar": self.grammar}
        if self.type in needed and needed[self.type] is None:
            raise ValueError(f"type {self.type!r} needs the field {self.type!r}")
        for other, value in needed.items():
            if other != self.type and value is not None:
                raise ValueError(f"the field {other!r} belongs to type {other!r}, not {self.type!r}")
        return self
