"""OpenAI Responses API request bodies (POST /v1/responses).

Policy: fields that cannot change the output (metadata, user, caching hints, service tier,
reasoning effort) are accepted and ignored; fields that would change it and that this
worker cannot honour (built-in tools, images and files, background runs, truncation,
conversations, stored prompts) are 400s naming the field. Unknown fields are 400s.

The input items a request carries are in responses_items.py; this module holds the request
body and its settings (tools, tool choice, text format, reasoning, streaming).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llorch.api.fields import MAX_ID_CHARS, MAX_PROMPT_CHARS, UINT64_MAX, MinP, RepetitionPenalty, TopK
from llorch.api.openai_fields import FunctionName, Strict
from llorch.api.openai_tools import MAX_TOOLS
from llorch.api.responses_items import INPUT_ITEMS, ITEM_TYPES, InputItem, MessageItem, _item_type, item_error
from llorch.engine.request import Constraint, SamplingParams

MAX_METADATA_KEYS = 16
# `include` values that ask for output of built-in tools or image inputs: none of those ever occurs here,
# so asking for them adds nothing and changes nothing.
HARMLESS_INCLUDES = frozenset({"file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                               "message.input_image.image_url", "computer_call_output.output.image_url",
                               "code_interpreter_call.outputs"})


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    def for_template(self) -> dict[str, Any]:
        """The tool in chat completions' shape, which templates and the call grammar read."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}

    def echoed(self) -> dict[str, Any]:
        # The call grammar keeps arguments to the schema, so every function behaves as strict.
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": True if self.strict is None else self.strict}


class FunctionChoice(Strict):
    type: Literal["function"]
    name: FunctionName


class AllowedFunction(Strict):
    type: Literal["function"]
    name: FunctionName


class AllowedTools(Strict):
    """Only these tools may be called (all stay described to the model)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedFunction] = Field(min_length=1, max_length=MAX_TOOLS)


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    name: FunctionName
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _medium(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise ValueError(f"{value!r} is not supported: the model writes as it writes (only 'medium')")
        return value


class ReasoningConfig(Strict):
    """Accepted and ignored: a model that thinks does so at its own length here."""

    effort: str | None = Field(default=None, max_length=32)
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: str | None = Field(default=None, max_length=32)
    mode: str | None = Field(default=None, max_length=32)


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # padding against side channels: nothing to pad here


class CacheOptions(Strict):
    mode: str | None = Field(default=None, max_length=32)
    ttl: str | None = Field(default=None, max_length=32)


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice | AllowedTools


class ResponseRequest(Strict):
    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    input: str | list[InputItem]
    instructions: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=MAX_METADATA_KEYS)
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = Field(default=None, max_length=16)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    background: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)  # limits built-in tools, of which there are none
    # Accepted and ignored: they identify the caller or steer caching, never the output.
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    safety_identifier: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: CacheOptions | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # Features this worker does not have: only null is accepted.
    conversation: Any = None
    prompt: Any = None
    moderation: Any = None
    context_management: Any = None
    # llorch extras, sent by the openai client through `extra_body`
    seed: int | None = Field(default=None, ge=0, le=UINT64_MAX)
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        """Clear messages for unsupported item types and for strings past the length limit."""
        if isinstance(value, str) and len(value) > MAX_PROMPT_CHARS:
            raise ValueError(f"the input is {len(value)} characters; at most {MAX_PROMPT_CHARS} are accepted")
        if isinstance(value, list):
            if not value:
                raise ValueError("the list of input items is empty")
            for index, item in enumerate(value):
                kind = _item_type(item)
                if isinstance(item, dict) and kind not in ITEM_TYPES:
                    raise ValueError(f"item {index} has type {str(kind)[:40]!r}; this worker reads "
                                     f"{', '.join(ITEM_TYPES)} items")
            try:  # here, so that a bad item is named alone (the union with str would add its own complaint)
                INPUT_ITEMS.validate_python(value)
            except ValidationError as exc:
                raise ValueError("; ".join(item_error(error) for error in exc.errors(include_url=False))) from None
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for index, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tool {index} is the built-in tool {kind[:40]!r}, which this worker does not "
                                 "have; only function tools are supported")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind not in ("function", "allowed_tools"):
            raise ValueError(f"{kind[:40]!r} is not supported: choose none, auto, required, a function "
                             "({type: function, name}) or allowed_tools")
        return value

    @model_validator(mode="after")
    def _supported(self) -> ResponseRequest:
        for name in ("conversation", "prompt", "moderation", "context_management"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not supported by this worker")
        if self.background:
            raise ValueError("background: background responses are not supported; the answer comes on this request")
        if self.truncation == "auto":
            raise ValueError("truncation: 'auto' (dropping earlier input to fit the context) is not supported; "
                             "use 'disabled'")
        for value in self.include or []:
            if value not in HARMLESS_INCLUDES:
                raise ValueError(f"include: {value[:60]!r} is not supported by this worker")
        if self.top_logprobs:
            raise ValueError("top_logprobs: log-probabilities are not supported on /v1/responses "
                             "(use /v1/chat/completions)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @model_validator(mode="after")
    def _tools(self) -> ResponseRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be distinct")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: it needs tools")
        named = [self.tool_choice.name] if isinstance(self.tool_choice, FunctionChoice) else [
            t.name for t in self.tool_choice.tools] if isinstance(self.tool_choice, AllowedTools) else []
        for name in named:
            if name not in names:
                raise ValueError(f"tool_choice: it names {name!r}, which is not among the tools")
        formatted = self.text is not None and self.text.format is not None and self.text.format.type != "text"
        if self.tools and self.tool_choice != "none" and formatted:
            raise ValueError("text.format: an output format cannot be combined with tools unless tool_choice "
                             "is \"none\"")
        return self

    @property
    def items(self) -> list[Any]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def tool_mode(self) -> str | None:
        """None (no tools in play), "none", "auto", "required", or the one function's name."""
        if not self.tools:
            return None
        if isinstance(self.tool_choice, FunctionChoice):
            return self.tool_choice.name
        if isinstance(self.tool_choice, AllowedTools):
            return self.tool_choice.mode
        return self.tool_choice or "auto"

    @property
    def callable_tools(self) -> list[FunctionTool]:
        """The tools the model may call: all, or those allowed_tools lists."""
        if isinstance(self.tool_choice, AllowedTools):
            allowed = {t.name for t in self.tool_choice.tools}
            return [t for t in self.tools or [] if t.name in allowed]
        return list(self.tools or [])

    def constraint(self) -> Constraint | None:
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, JsonObjectFormat):
            return Constraint("json_schema", '{"type": "object"}', "text.format")
        if isinstance(fmt, JsonSchemaFormat):
            return Constraint("json_schema", json.dumps(fmt.schema_), "text.format.schema")
        return None

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature, top_k=self.top_k,
                              top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, seed=self.seed)

    def echoed_text(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None else None
        shown = fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}
        return {"format": shown, "verbosity": "medium"}

    def echoed_tool_choice(self) -> Any:
        if isinstance(self.tool_choice, BaseModel):
            return self.tool_choice.model_dump(exclude_none=True)
        return self.tool_choice or "auto"
