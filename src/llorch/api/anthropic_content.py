"""What an Anthropic conversation is made of: content blocks (text, tool use, tool results, thinking) and messages.

Apart from the request bodies (anthropic_schemas.py), which add tools, choices and settings: the
blocks are checked one by one before the model is built, so a bad block gets one message naming
it instead of a complaint from every member of the union; images and documents are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from llorch.api.fields import MAX_ID_CHARS, MAX_PROMPT_CHARS
from llorch.api.openai_fields import FunctionName

IdText = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
# Block types Anthropic has that this worker cannot read: answered with a 400 naming them.
UNSUPPORTED_BLOCKS = {"image": "images", "document": "documents", "search_result": "search results",
                      "container_upload": "container uploads"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here (prefix cache)
    citations: list[dict[str, Any]] | None = None  # sources an earlier answer cited: not read


class ToolUseBlock(Strict):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: IdText
    name: FunctionName
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: IdText
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return checked_text(value, "tool_result content")

    @property
    def text(self) -> str:
        text = joined(self.content)
        return f"Error: {text}" if self.is_error else text  # the model should know the call failed


class ThinkingBlock(Strict):
    """An earlier turn's reasoning: accepted in history, not shown to the model again."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]
BLOCK = TypeAdapter(Block)
TEXT_BLOCK = TypeAdapter(TextBlock)


def first_problem(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in error["loc"][1:])  # loc[0] is the union's tag (the block type)
    return f"{where}: {error['msg']}" if where else error["msg"]


def checked_blocks(value: Any, allowed: TypeAdapter[Any], what: str) -> Any:
    """`value` unchanged when it is a string or a list of blocks `allowed` accepts; else one clear ValueError."""
    if isinstance(value, str):
        texts = [value]
    elif isinstance(value, list):
        texts = []
        for index, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in UNSUPPORTED_BLOCKS:
                raise ValueError(f"{what} block {index} has type {kind!r}: this worker reads text only "
                                 f"({UNSUPPORTED_BLOCKS[kind]} are not supported)")
            if not isinstance(kind, str):
                raise ValueError(f"{what} block {index} is not an object with a string 'type'")
            try:
                allowed.validate_python(block)
            except ValidationError as exc:
                raise ValueError(f"{what} block {index} ({kind[:40]}): {first_problem(exc)}") from None
            if kind == "text":
                texts.append(block.get("text", ""))
    else:
        raise ValueError(f"{what} must be a string or a list of content blocks, not {type(value).__name__}")
    length = sum(len(text) for text in texts)
    if length > MAX_PROMPT_CHARS:
        raise ValueError(f"{what} is {length} characters; at most {MAX_PROMPT_CHARS} are accepted")
    return value


def checked_text(value: Any, what: str) -> Any:
    return checked_blocks(value, TEXT_BLOCK, what)


def joined(content: str | list[TextBlock]) -> str:
    """Text blocks read as one text, as the OpenAI API joins text parts."""
    return content if isinstance(content, str) else "".join(block.text for block in content)


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, value: Any) -> Any:
        return checked_blocks(value, BLOCK, "content")

    @model_validator(mode="after")
    def _roles(self) -> Message:
        if not self.content:
            raise ValueError("content: a message needs non-empty content")
        blocks = [] if isinstance(self.content, str) else self.content
        allowed = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
        for index, block in enumerate(blocks):
            if block.type not in allowed[self.role]:
                raise ValueError(f"content: block {index} is a {block.type} block, which {self.role} messages "
                                 f"cannot carry")
        return self
