"""Chat templates: the model's own jinja2 template, rendered in jinja2's sandbox.

A template comes with the model (GGUF `tokenizer.chat_template`, or tokenizer_config.json)
or from a file the operator names. Templates are untrusted text, so they render in an
immutable sandbox: no attribute games, no mutation of what we pass in.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llorch.weights.tool_prompt import as_plain_turns


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or is broken)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", name: str = "custom") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.name = name  # where it came from: "model", "file", or "family:<name>" (shown by /v1/models)
        # Templates that read `tools` get them; others get the default convention's plain turns (tool_prompt.py).
        self.reads_tools = "tools" in source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The prompt for `messages`; `tools` (OpenAI's function definitions) go to templates that read them."""
        uses_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        if uses_tools and not self.reads_tools:
            messages, tools = as_plain_turns(list(messages), list(tools) if tools else None), None
        try:
            return self._template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
