"""Anthropic Messages request bodies (/v1/messages, /v1/messages/count_tokens).

Field policy: what changes the output is applied or refused with a 400 naming it; fields
that cannot change it here (metadata, cache_control, service tier, region, citations of
earlier answers) are accepted and ignored. Unknown fields are refused: they might.
Content blocks are checked one by one before the model is built, so a bad block gets one
message naming it instead of a complaint from every member of the union.

The blocks and messages are in anthropic_content.py; this module holds the request bodies and
their tools, tool choice, thinking and output settings.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llorch.api.anthropic_content import Message, Strict, TextBlock, ToolResultBlock, ToolUseBlock, checked_text, joined
from llorch.api.fields import MAX_ID_CHARS, StopString, TopK, TopP
from llorch.api.openai_fields import FunctionName
from llorch.api.openai_tools import MAX_TOOLS
from llorch.engine.request import Constraint, SamplingParams

MAX_STOP_SEQUENCES = 4  # as on the other APIs


class Tool(Strict):
    """A client tool. Server tools (web search, code execution, ...) carry another `type` and are refused."""

    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None  # calls always follow the schema here: a grammar enforces it
    cache_control: dict[str, Any] | None = None
    eager_input_streaming: bool | None = None  # how input is chunked in a stream; not what it says

    @field_validator("input_schema")
    @classmethod
    def _object(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError("input_schema must be a JSON schema with type 'object'")
        return value

    def openai_shape(self) -> dict[str, Any]:
        """The tool as chat templates and the tool grammar read it (OpenAI's function tool)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.input_schema  # after the description, as OpenAI's tools have it: same prompt
        return {"type": "function", "function": function}


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice: type 'tool' needs a name, and only it takes one")
        return self


class Thinking(Strict):
    """Accepted: a model whose template thinks has its reasoning returned as thinking blocks either way."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking: type 'enabled' needs budget_tokens")
        return self


class OutputFormat(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no such knob here: ignored


def _tools(value: Any) -> Any:
    """Server tools get a message of their own (pydantic would list every missing field)."""
    if isinstance(value, list):
        for index, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"tool {index} has type {str(kind)[:60]!r}: server tools are not supported; "
                                 "give client tools (name, description, input_schema)")
    return value


class MessagesInput(BaseModel):
    """What goes into the prompt: shared by /v1/messages and /v1/messages/count_tokens."""

    model_config = ConfigDict(extra="forbid")

    # Anthropic's clients always name a model; any name is accepted and the served model answers.
    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # Accepted and ignored: they cannot change what is generated here.
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, value: Any) -> Any:
        return value if value is None else checked_text(value, "system")

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, value: Any) -> Any:
        return _tools(value)

    @model_validator(mode="after")
    def _conversation(self) -> MessagesInput:
        if self.messages[-1].role == "assistant":
            raise ValueError("messages: the last message is the assistant's; continuing a prefilled assistant turn "
                             "is not supported: end with a user message")
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: tool names must be distinct")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice: type {choice.type!r} needs tools")
        if choice is not None and choice.name is not None and choice.name not in names:
            raise ValueError(f"tool_choice: names {choice.name!r}, which is not among the tools")
        calls: set[str] = set()
        for index, message in enumerate(self.messages):
            for block in message.content if isinstance(message.content, list) else []:
                if isinstance(block, ToolUseBlock):
                    calls.add(block.id)
                elif isinstance(block, ToolResultBlock) and block.tool_use_id not in calls:
                    raise ValueError(f"messages.{index}: tool_result for {block.tool_use_id[:60]!r}, which no earlier "
                                     "tool_use block has as its id")
        return self

    @property
    def tool_mode(self) -> str | None:
        """The tool grammar's mode: None (no tools), "none", "auto", "required" or the one tool's name."""
        if not self.tools:
            return None
        choice = self.tool_choice
        if choice is None or choice.type == "auto":
            return "auto"
        return {"any": "required", "none": "none"}.get(choice.type, choice.name)

    @property
    def parallel_tool_calls(self) -> bool:
        return not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)

    def openai_tools(self) -> list[dict[str, Any]] | None:
        return [tool.openai_shape() for tool in self.tools] if self.tools else None

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template messages (OpenAI's shape, arguments as objects).

        Tool results become `tool` messages before the user's text; thinking blocks are dropped;
        consecutive turns of one role are combined into one, as Anthropic does.
        """
        names: dict[str, str] = {}
        turns: list[dict[str, Any]] = []
        if self.system is not None:
            turns.append({"role": "system", "content": joined(self.system)})
        for message in self.messages:
            if isinstance(message.content, str):
                append_turn(turns, {"role": message.role, "content": message.content})
                continue
            text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
            if message.role == "assistant":
                turn: dict[str, Any] = {"role": "assistant", "content": text}
                calls = [block for block in message.content if isinstance(block, ToolUseBlock)]
                if calls:
                    names.update((call.id, call.name) for call in calls)
                    turn["tool_calls"] = [{"id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": call.input}}
                                          for call in calls]
                append_turn(turns, turn)
                continue
            for block in message.content:
                if isinstance(block, ToolResultBlock):
                    turns.append({"role": "tool", "content": block.text, "tool_call_id": block.tool_use_id,
                                  "name": names[block.tool_use_id]})
            if text or not any(isinstance(block, ToolResultBlock) for block in message.content):
                append_turn(turns, {"role": "user", "content": text})
        return turns


def append_turn(turns: list[dict[str, Any]], turn: dict[str, Any]) -> None:
    """Add a user or assistant turn, combining it with the one before when that has the same role."""
    last = turns[-1] if turns else None
    if last is None or last["role"] != turn["role"]:
        turns.append(turn)
        return
    last["content"] = "\n\n".join(text for text in (last["content"], turn["content"]) if text)
    if turn.get("tool_calls"):
        last["tool_calls"] = [*last.get("tool_calls", []), *turn["tool_calls"]]


class CountTokensRequest(MessagesInput):
    pass


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[StopString] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)  # Anthropic's range
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None  # ignored: who asked does not change the answer

    @model_validator(mode="after")
    def _one_constraint(self) -> MessagesRequest:
        formatted = self.output_config is not None and self.output_config.format is not None
        if formatted and self.tool_mode not in (None, "none"):
            raise ValueError("output_config: an output format cannot be combined with tools unless tool_choice "
                             "is {\"type\": \"none\"}")
        return self

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k or 0,
                              top_p=1.0 if self.top_p is None else self.top_p)

    def format_constraint(self) -> Constraint | None:
        """The structured-output constraint of output_config.format, if any."""
        if self.output_config is None or self.output_config.format is None:
            return None
        return Constraint("json_schema", json.dumps(self.output_config.format.schema_), "output_config.format.schema")
