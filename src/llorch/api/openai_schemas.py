"""OpenAI API request bodies.

The policy for fields (README's table): what cannot change the output is accepted and
ignored (`user`, `store`, `metadata`, `service_tier`, `prompt_cache_key`, ...; `refusal`,
`annotations` and provider extras on assistant messages sent back; null for any optional
field); what changes it is applied (`min_tokens`, `ignore_eos`, `chat_template_kwargs`,
`add_generation_prompt`, `continue_final_message`, legacy `functions`); anything else
unknown or unsupported is a 400 naming the field, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from llorch.api.schemas import (
    MAX_ID_CHARS,
    MAX_PROMPT_CHARS,
    UINT64_MAX,
    MinP,
    RepetitionPenalty,
    Seed,
    StopString,
    Temperature,
    TopK,
    TopP,
    sampling_params,
    stop_tuple,
)
from llorch.engine.request import IGNORE_EOS, ChatOptions, Constraint, SamplingParams

MAX_CHOICES = 8
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each with its n choices)
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
TokenId = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    """A request part whose unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


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


def without_nulls(data: Any) -> Any:
    """A body's fields without those sent as null: an optional field sent as null means its default."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class OpenAIRequest(BaseModel):
    """Parameters shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    # Absent: the served model.
    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = Field(default=None)
    seed: Seed = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # Token id (as a string, as OpenAI has it) -> a bias in [-100, 100] added to its logit before sampling.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(default=None,
                                                                                   max_length=MAX_LOGIT_BIAS)
    # Accepted and ignored: none of them changes the output.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    service_tier: str | None = Field(default=None, max_length=64)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    safety_identifier: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    # Applied: a floor on generated tokens before end-of-generation may come, or none at all.
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    # llorch extras, sent by the openai client through `extra_body`
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    # Constrained output: OpenAI's response_format, or llorch's shorthands `regex` and `grammar` (Lark).
    response_format: ResponseFormat | None = None
    regex: str | None = None
    grammar: str | None = None

    _nulls = model_validator(mode="before")(without_nulls)

    @model_validator(mode="after")
    def _one_constraint(self) -> OpenAIRequest:
        formatted = self.response_format is not None and self.response_format.type != "text"
        given = [name for name, on in (("response_format", formatted), ("regex", self.regex is not None),
                                       ("grammar", self.grammar is not None)) if on]
        if len(given) > 1:
            raise ValueError(f"at most one output constraint per request; got {', '.join(given)}")
        return self

    @model_validator(mode="after")
    def _supported(self) -> OpenAIRequest:
        for key in self.logit_bias or {}:
            if not key.isascii() or not key.isdigit() or len(key) > 9:
                raise ValueError(f"logit_bias: key {key[:40]!r} is not a token id (a non-negative integer)")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 sequences")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than max_tokens ({self.max_tokens})")
        if (self.min_tokens or self.ignore_eos) and self.constraint() is not None:
            raise ValueError("min_tokens: min_tokens and ignore_eos cannot be combined with an output constraint, "
                             "which decides where the output ends")
        return self

    def constraint(self) -> Constraint | None:
        """The output constraint asked for, naming the field it came from (None: free text)."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return Constraint("json_schema", '{"type": "object"}', "response_format")
        if fmt is not None and fmt.json_schema is not None:
            return Constraint("json_schema", json.dumps(fmt.json_schema.schema_), "response_format.json_schema.schema")
        if fmt is not None and fmt.regex is not None:
            return Constraint("regex", fmt.regex, "response_format.regex")
        if fmt is not None and fmt.grammar is not None:
            return Constraint("lark", fmt.grammar, "response_format.grammar")
        if self.regex is not None:
            return Constraint("regex", self.regex, "regex")
        if self.grammar is not None:
            return Constraint("lark", self.grammar, "grammar")
        return None

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, choice: int) -> SamplingParams:
        # Each of n choices gets its own generator: seed, seed+1, ... (reproducible as a set).
        seed = None if self.seed is None else (self.seed + choice) % (UINT64_MAX + 1)
        bias = tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items()))
        return sampling_params(self, seed, presence_penalty=self.presence_penalty,
                               frequency_penalty=self.frequency_penalty, logit_bias=bias,
                               min_tokens=IGNORE_EOS if self.ignore_eos else self.min_tokens)


class CompletionRequest(OpenAIRequest):
    # Pydantic tries each form strictly first, so ["1"] stays text and [1] stays a token id.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_form(cls, value: Any) -> Any:
        """A clear message for a list that mixes forms (pydantic would list each form's complaint), and
        the length limit on texts before anything tokenizes them."""
        if isinstance(value, list) and value:
            kinds = {"text" if isinstance(v, str) else "token ids" if isinstance(v, list) else "a token id"
                     for v in value}
            if len(kinds) > 1:
                raise ValueError(f"a list mixes {' and '.join(sorted(kinds))}: give one text, a list of texts, "
                                 "a list of token ids or a list of such lists")
        texts = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        for index, text in enumerate(texts):
            if isinstance(text, str) and len(text) > MAX_PROMPT_CHARS:
                where = "" if isinstance(value, str) else f" (prompt {index})"
                raise ValueError(f"the prompt{where} is {len(text)} characters; at most {MAX_PROMPT_CHARS} "
                                 "are accepted")
        return value

    @model_validator(mode="after")
    def _prompts(self) -> CompletionRequest:
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt: the list is empty; give a prompt, a list of prompts or a list of token ids")
            if isinstance(self.prompt[0], str | list) and len(self.prompt) > MAX_PROMPTS:
                raise ValueError(f"prompt: {len(self.prompt)} prompts; at most {MAX_PROMPTS} per request")
            if isinstance(self.prompt[0], list) and not all(self.prompt):
                index = next(i for i, ids in enumerate(self.prompt) if not ids)
                raise ValueError(f"prompt.{index}: an empty list of token ids")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo=true (score the prompt, generate nothing)")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


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


class FunctionDefinition(Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128


# Template variables a request may not set: the template's own arguments.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # The legacy form of tools: function definitions and a choice among them; the answer is a `function_call`.
    functions: list[FunctionDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    # Accepted and ignored: they tune models that this worker does not serve differently.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = None
    # Applied: how the conversation renders.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _legacy_functions(self) -> ChatCompletionRequest:
        """Legacy `functions` / `function_call` become tools and tool_choice (one call, answered the legacy way)."""
        if self.function_call is not None and not self.functions:
            raise ValueError("function_call needs functions")
        if self.functions:
            if self.tools:
                raise ValueError("functions: give tools or the legacy functions, not both")
            self.tools = [Tool(type="function", function=f) for f in self.functions]
            choice = self.function_call
            self.tool_choice = NamedToolChoice(type="function", function=choice) if isinstance(
                choice, NamedFunction) else choice
            self.parallel_tool_calls = False
        return self

    @model_validator(mode="after")
    def _rendering(self) -> ChatCompletionRequest:
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here")
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in \
                self.model_fields_set:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true")
        if (self.min_tokens or self.ignore_eos) and self.tools and self.tool_choice != "none":
            raise ValueError("min_tokens: min_tokens and ignore_eos cannot be combined with tools")
        return self

    @property
    def legacy_functions(self) -> bool:
        return bool(self.functions)

    def chat_options(self) -> ChatOptions:
        return ChatOptions(self.add_generation_prompt, self.continue_final_message,
                           tuple(sorted((self.chat_template_kwargs or {}).items())))

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be distinct")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        calls_tools = self.tools and self.tool_choice != "none"
        if calls_tools and (self.regex is not None or self.grammar is not None or (
                self.response_format is not None and self.response_format.type != "text")):
            raise ValueError("an output constraint (response_format, regex, grammar) cannot be combined with tools "
                             "unless tool_choice is \"none\"")
        return self

    @property
    def tool_mode(self) -> str | None:
        """None (no tools in play), "none", "auto", "required", or the one function's name."""
        if not self.tools:
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"
