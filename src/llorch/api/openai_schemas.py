"""OpenAI API request bodies.

The policy for fields (README's table): what cannot change the output is accepted and
ignored (`user`, `store`, `metadata`, `service_tier`, `prompt_cache_key`, ...; `refusal`,
`annotations` and provider extras on assistant messages sent back; null for any optional
field); what changes it is applied (`min_tokens`, `ignore_eos`, `chat_template_kwargs`,
`add_generation_prompt`, `continue_final_message`, legacy `functions`); anything else
unknown or unsupported is a 400 naming the field, never silently ignored.

This module holds the two bodies, CompletionRequest and ChatCompletionRequest; the parts they
are built from live apart: the shared fields (openai_request.py), messages (openai_messages.py),
tools (openai_tools.py), response_format (openai_response_format.py) and the field types other
APIs reuse (openai_fields.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llorch.api.fields import MAX_PROMPT_CHARS
from llorch.api.openai_fields import MAX_TOP_LOGPROBS, TokenId
from llorch.api.openai_messages import ChatMessage
from llorch.api.openai_request import OpenAIRequest
from llorch.api.openai_tools import MAX_TOOLS, FunctionDefinition, NamedFunction, NamedToolChoice, Tool
from llorch.engine.request import ChatOptions

MAX_PROMPTS = 64  # prompts in one /v1/completions request (each with its n choices)


# Template variables a request may not set: the template's own arguments.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


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
