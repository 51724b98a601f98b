"""Chat messages as OpenAI's chat completions take them: text content, tool calls and their answers.

Apart from the request bodies because more than chat completions read them (llama-server's
/apply-template, /tokenize with messages); each message renders itself for the chat template.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llorch.api.fields import MAX_ID_CHARS, MAX_PROMPT_CHARS
from llorch.api.openai_fields import FunctionName, Strict, without_nulls


class TextPart(Strict):
    type: Literal["text"]
    text: str


class CalledFunction(Strict):
    name: FunctionName
    arguments: str  # JSON text, as the model wrote it

    @model_validator(mode="after")
    def _json_arguments(self) -> CalledFunction:
        try:
            json.loads(self.arguments)
        except ValueError as exc:
            raise ValueError(f"tool call arguments are not JSON: {exc}") from exc
        return self


class ToolCall(Strict):
    id: str = Field(max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)  # a tool turn: the call it answers
    function_call: CalledFunction | None = None  # the legacy form of one call (answered by a "function" message)
    # What clients send back of an earlier answer, accepted and ignored: nothing a template reads.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None  # null only: audio is not supported
    reasoning_content: str | None = None
    provider_specific_fields: dict[str, Any] | None = None

    _nulls = model_validator(mode="before")(without_nulls)

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, value: Any) -> Any:
        """Say what is wrong with content in one message (pydantic would list each union member's complaint)."""
        if value is None or isinstance(value, str):
            parts = [value] if value else []
        elif isinstance(value, list):
            for index, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    shown = f"type {kind!r}" if isinstance(kind, str) else "no type 'text'"
                    raise ValueError(f"content part {index} has {shown}; this worker reads text parts only "
                                     "(images, audio and files are not supported)")
            parts = [part.get("text") for part in value]
        else:
            raise ValueError(f"content must be a string, a list of text parts or null, not {type(value).__name__}")
        length = sum(len(text) for text in parts if isinstance(text, str))
        if length > MAX_PROMPT_CHARS:
            raise ValueError(f"the message is {length} characters; at most {MAX_PROMPT_CHARS} are accepted")
        return value

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        calls = self.tool_calls or self.function_call
        if self.content is None and not (self.role == "assistant" and calls):
            raise ValueError(f"a {self.role} message needs content")
        if calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls or function_call")
        if self.tool_calls and self.function_call:
            raise ValueError("a message carries tool_calls or the legacy function_call, not both")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs the name of the function it answers")
        return self

    def for_template(self) -> dict[str, Any]:
        if self.content is None:
            text = ""
        else:
            text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # Templates know "system" and "tool"; OpenAI's "developer" and legacy "function" roles mean the same.
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        message: dict[str, Any] = {"role": role, "content": text}
        calls = self.tool_calls or ([ToolCall(id=legacy_call_id(self.function_call.name), function=self.function_call)]
                                    if self.function_call else [])
        if calls:  # templates read arguments as objects, not JSON text
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in calls]
        if self.tool_call_id is not None or self.role == "function":
            message["tool_call_id"] = self.tool_call_id or legacy_call_id(self.name or "")
        if self.name is not None and role == "tool":
            message["name"] = self.name
        return message


def legacy_call_id(name: str) -> str:
    """The id a legacy function call and its answer share (the legacy API pairs them by name)."""
    return f"call_{name}"
