"""The Responses API's input items: messages, function calls, their outputs and reasoning.

Apart from the request body because the items outlive a request: a stored conversation's
items are checked again (INPUT_ITEMS) when a later request continues it. Content is text
only; each check says in one message what is wrong with an item.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, field_validator

from llorch.api.fields import MAX_ID_CHARS, MAX_PROMPT_CHARS
from llorch.api.openai_fields import FunctionName, Strict

ItemStatus = Literal["in_progress", "completed", "incomplete"]
TEXT_PARTS = ("input_text", "output_text", "refusal")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    """An assistant's text, as an earlier response's output carries it back in."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


TextPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


def text_parts(value: Any, what: str) -> Any:
    """Say in one message what is wrong with content (pydantic would list each union member's complaint)."""
    if isinstance(value, str):
        length = len(value)
    elif isinstance(value, list):
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS:
                shown = f"has type {kind[:40]!r}" if isinstance(kind, str) else "has no text type"
                raise ValueError(f"{what} part {index} {shown}; this worker reads text only "
                                 f"({', '.join(TEXT_PARTS)}): images, files and audio are not supported")
        length = sum(len(p.get("text") or p.get("refusal") or "") for p in value if isinstance(p, dict))
    else:
        raise ValueError(f"{what} must be a string or a list of text parts, not {type(value).__name__}")
    if length > MAX_PROMPT_CHARS:
        raise ValueError(f"{what} is {length} characters; at most {MAX_PROMPT_CHARS} are accepted")
    return value


def joined(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in content)


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return text_parts(value, "content")

    @property
    def text(self) -> str:
        return joined(self.content)


class FunctionCallItem(Strict):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: FunctionName
    arguments: str  # JSON text
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    status: ItemStatus | None = None

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"arguments are not JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object")
        return value


class FunctionCallOutputItem(Strict):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: str | list[TextPart]
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    status: ItemStatus | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return text_parts(value, "output")

    @property
    def text(self) -> str:
        return joined(self.output)


class ReasoningItem(Strict):
    """An earlier turn's thoughts: accepted in history and dropped (templates do not read old thoughts)."""

    type: Literal["reasoning"]
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


# Imported by responses_schemas.py under this name: pydantic names the function in its messages.
def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")  # a bare {role, content} is a message
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
INPUT_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


def item_error(error: Any) -> str:
    """"item 2, content: why", without the item type pydantic puts in the location."""
    index, *where = error["loc"]
    where = [str(part) for part in where[1:]] if where and where[0] in ITEM_TYPES else [str(p) for p in where]
    message = error["msg"].removeprefix("Value error, ")
    return f"item {index}{', ' + '.'.join(where) if where else ''}: {message}"
