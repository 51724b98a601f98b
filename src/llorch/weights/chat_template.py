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


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or is broken)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
