"""Ollama API request bodies (/api/chat, /api/generate, /api/show).

Options that cannot change the output (where and how the runner loads the model: num_ctx,
num_gpu, num_thread, ...) are accepted and ignored; sampling options are applied; options
that would change the output and have no counterpart here are a 400 naming them, unless
they hold their "off" value. Unknown fields are 400s too.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llorch.api.fields import (
    MAX_ID_CHARS,
    MAX_PROMPT_CHARS,
    UINT64_MAX,
    MinP,
    RepetitionPenalty,
    StopString,
    Temperature,
    TopK,
    TopP,
    sampling_params,
    stop_tuple,
)
from llorch.api.openai_fields import MAX_TOP_LOGPROBS, FunctionName
from llorch.api.openai_tools import MAX_TOOLS, FunctionDefinition
from llorch.api.pooling_schemas import MAX_INPUTS, Text, check_texts
from llorch.engine.request import Constraint, SamplingParams

# Ollama's documented defaults for a model whose Modelfile sets none.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9
MAX_STOPS = 4
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Options(Strict):
    """`options`: sampling and length are applied; the runner's settings are accepted and ignored."""

    temperature: Temperature = DEFAULT_TEMPERATURE
    top_p: TopP = DEFAULT_TOP_P
    top_k: TopK = DEFAULT_TOP_K
    min_p: MinP = 0.0
    seed: int | None = Field(default=None, ge=-1, le=UINT64_MAX)  # -1: random, as in Ollama
    num_predict: int | None = Field(default=None, ge=-2)  # -1: no limit, -2: fill the context
    stop: StopString | list[StopString] | None = None
    repeat_penalty: RepetitionPenalty = 1.0
    repeat_last_n: int | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # Samplers this worker does not have: accepted only at their "off" value.
    mirostat: int = 0
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    tfs_z: float = 1.0
    typical_p: float = 1.0
    # Where and how the model runs, or context shifting this worker never does: no effect on the output.
    num_ctx: int | None = None
    num_keep: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    penalize_newline: bool | None = None  # Ollama's own engine ignores it

    @model_validator(mode="after")
    def _supported(self) -> Options:
        if self.num_predict == 0:
            raise ValueError("num_predict: 0 generates nothing; give a positive number, -1 (no limit) "
                             "or -2 (fill the context)")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOPS:
            raise ValueError(f"stop: at most {MAX_STOPS} sequences")
        if self.repeat_last_n not in (None, -1, 0):
            raise ValueError("repeat_last_n: only -1 (the whole context, which repeat_penalty always "
                             "covers here) and 0 (no penalty) are supported")
        if self.mirostat != 0:
            raise ValueError("mirostat: mirostat sampling is not supported (only 0, off)")
        if self.tfs_z != 1.0:
            raise ValueError("tfs_z: tail-free sampling is not supported (only 1.0, off)")
        if self.typical_p != 1.0:
            raise ValueError("typical_p: typical sampling is not supported (only 1.0, off)")
        return self

    @property
    def max_tokens(self) -> int | None:
        """The engine's max_tokens: None runs to the end of generation or of the context."""
        return self.num_predict if self.num_predict is not None and self.num_predict > 0 else None

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)

    @property
    def repetition_penalty(self) -> float:
        return 1.0 if self.repeat_last_n == 0 else self.repeat_penalty

    def sampling(self) -> SamplingParams:
        seed = None if self.seed is None or self.seed < 0 else self.seed
        return sampling_params(self, seed, presence_penalty=self.presence_penalty,
                               frequency_penalty=self.frequency_penalty)


class CalledFunction(Strict):
    name: FunctionName
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None  # the call's place in its turn, as newer Ollama versions send it

    @field_validator("arguments", mode="before")
    @classmethod
    def _object(cls, value: Any) -> Any:
        """Ollama sends an object; JSON text of an object (OpenAI's habit) is read as that object."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"arguments are neither an object nor JSON text: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("arguments must be an object")
        return value


class ToolCall(Strict):
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    images: list[str] | None = None
    thinking: str | None = None  # an earlier turn's thoughts: templates leave them out
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = Field(default=None, max_length=MAX_ID_CHARS)  # a tool turn: which tool answered
    name: str | None = Field(default=None, max_length=MAX_ID_CHARS)  # the same, as older clients call it
    tool_call_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.images:
            raise ValueError("images: this worker serves a text model; images are not supported")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        return self

    def for_template(self, call_ids: list[str]) -> dict[str, Any]:
        """The message as chat templates read it; `call_ids` gives ids to calls that came without one."""
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id or call_ids.pop(0), "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}} for call in self.tool_calls]
        if self.role == "tool":
            tool = self.tool_name or self.name
            if tool is not None:
                message["name"] = tool
            if self.tool_call_id is not None:
                message["tool_call_id"] = self.tool_call_id
        return message


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


Format = Literal["", "json"] | dict[str, Any] | None
Think = bool | Literal["high", "medium", "low"] | None


class GenerationBody(Strict):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    format: Format = None
    options: Options = Field(default_factory=Options)
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: float | str | None = None  # the model never unloads here
    think: Think = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    truncate: bool | None = None  # only matters past the context, where this worker answers 400 instead
    shift: bool | None = None

    @field_validator("format", mode="before")
    @classmethod
    def _format(cls, value: Any) -> Any:
        if value is None or value in ("", "json") or isinstance(value, dict):
            return value
        raise ValueError('format must be "json" or a JSON schema object')

    @model_validator(mode="after")
    def _logprobs(self) -> GenerationBody:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    def constraint(self) -> Constraint | None:
        if self.format == "json":
            return Constraint("json_schema", '{"type": "object"}', "format")
        if isinstance(self.format, dict):
            return Constraint("json_schema", json.dumps(self.format), "format")
        return None

    @property
    def thinks(self) -> bool:
        """Whether the request asks for thinking (any level)."""
        return self.think is not None and self.think is not False

    @property
    def logprob_count(self) -> int | None:
        """The engine's logprobs: None (off) or how many alternatives to report."""
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatRequest(GenerationBody):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be distinct")
        if self.tools and self.constraint() is not None:
            raise ValueError("format: cannot be combined with tools (a tool call has its own format)")
        return self


class GenerateRequest(GenerationBody):
    prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS)
    system: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None

    @model_validator(mode="after")
    def _supported(self) -> GenerateRequest:
        if self.suffix:
            raise ValueError("suffix: fill-in-the-middle is not supported")
        if self.template:
            raise ValueError("template: a per-request prompt template is not supported; the prompt goes through "
                             "the model's chat template, or as it is with raw=true")
        if self.context:
            raise ValueError("context: continuing from returned token context is not supported; send the "
                             "conversation to /api/chat instead")
        if self.images:
            raise ValueError("images: this worker serves a text model; images are not supported")
        if self.raw and self.system is not None:
            raise ValueError("system: raw=true sends the prompt as it is, so there is no template for the "
                             "system prompt to go into")
        return self


class ShowRequest(Strict):
    model: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    name: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)  # its older spelling
    verbose: bool = False

    @model_validator(mode="after")
    def _named(self) -> ShowRequest:
        if self.model is None and self.name is None:
            raise ValueError("model: required")
        return self

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""


class EmbedRequest(Strict):
    """/api/embed: one text or a list; Ollama cuts texts past the context unless `truncate` is false."""

    model: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] | None = None  # runtime settings (threads, context): none changes a vector
    keep_alive: str | int | None = None  # the model stays loaded for the worker's life

    @field_validator("input")
    @classmethod
    def _texts(cls, value: str | list[str]) -> str | list[str]:
        check_texts([value] if isinstance(value, str) else value, "input")
        return value


class LegacyEmbeddingsRequest(Strict):
    """/api/embeddings, the older route: one prompt, its vector not normalized by the route."""

    model: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    prompt: Text
    options: dict[str, Any] | None = None
    keep_alive: str | int | None = None

    @field_validator("prompt")
    @classmethod
    def _text(cls, value: str) -> str:
        return check_texts([value], "prompt")[0]
