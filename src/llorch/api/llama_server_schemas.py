"""llama-server's request bodies besides /completion: the `content` form of POST /tokenize, POST /apply-template.

Also one_prompt, the reading of llama-server's `prompt` (or `content`) that /completion's body
(llama_server_completion_schemas.py, apart for its size) shares with /tokenize. The field policy
is the OpenAI API's (openai_schemas.py); README's table says which field is which.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llorch.api.fields import MAX_PROMPT_CHARS
from llorch.api.openai_fields import without_nulls
from llorch.api.openai_messages import ChatMessage
from llorch.api.openai_schemas import RESERVED_TEMPLATE_VARIABLES
from llorch.api.openai_tools import MAX_TOOLS, Tool
from llorch.engine.request import ChatOptions


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def one_prompt(value: Any) -> str | list[int | str]:
    """llama-server's `prompt` (or /tokenize's `content`) as one prompt: a text, or token ids and texts in order.

    Several prompts in one request (a list of texts, or a list of lists) are refused: one request, one prompt.
    """
    if isinstance(value, str):
        parts: list[Any] = [value]
    elif isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        parts = value[0]  # a list holding one prompt
    elif isinstance(value, list):
        parts = value
    else:
        raise ValueError("give a string, a list of token ids, or a list mixing token ids and strings")
    if not parts:
        raise ValueError("the prompt is empty")
    kinds = {type(part) for part in parts}
    if list in kinds or (kinds == {str} and len(parts) > 1):
        raise ValueError("several prompts in one request are not supported here; send one request per prompt")
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, int | str):
            raise ValueError(f"a prompt part must be a token id or a string, not {type(part).__name__}")
        if isinstance(part, int) and part < 0:
            raise ValueError(f"token id {part} is negative")
    length = sum(len(part) for part in parts if isinstance(part, str))
    if length > MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt is {length} characters; at most {MAX_PROMPT_CHARS} are accepted")
    return value if isinstance(value, str) else list(parts)


class LlamaTokenizeRequest(Strict):
    """llama-server's /tokenize body (llorch's own has `prompt` or `messages` instead of `content`)."""

    content: str | list[int | str]
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    model: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _one_content(cls, value: Any) -> Any:
        return one_prompt(value)

    @model_validator(mode="after")
    def _supported(self) -> LlamaTokenizeRequest:
        if not self.parse_special:
            raise ValueError("parse_special: only true is supported (special tokens spelled in the text are "
                             "read as those tokens)")
        return self


# Fields of each /tokenize form, to tell them apart (`model` belongs to both).
LLAMA_TOKENIZE_FIELDS = frozenset({"content", "add_special", "parse_special", "with_pieces"})


class ApplyTemplateRequest(Strict):
    """llama-server's /apply-template: chat messages rendered with the model's chat template, not generated."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None

    _nulls = model_validator(mode="before")(without_nulls)

    @model_validator(mode="after")
    def _template_variables(self) -> ApplyTemplateRequest:
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here")
        return self

    def chat_options(self) -> ChatOptions:
        return ChatOptions(self.add_generation_prompt, template_kwargs=tuple(sorted(
            (self.chat_template_kwargs or {}).items())))
