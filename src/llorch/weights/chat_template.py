"""Chat templates: the model's own jinja2 template, rendered in jinja2's sandbox.

A template comes with the model (GGUF `tokenizer.chat_template`, or tokenizer_config.json)
or from a file the operator names. Templates are untrusted programs, so they render in
jinja2's immutable sandbox (no attribute games, no mutation of what we pass in), inside a
helper process that bounds their time, memory and output (template_sandbox.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llorch.weights.template_sandbox import ChatTemplateError, shared_sandbox
from llorch.weights.tool_prompt import as_plain_turns

__all__ = ["ChatTemplate", "ChatTemplateError"]


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", name: str = "custom") -> None:
        """Compile `source` (in the sandbox process): a template that does not compile fails here."""
        self._digest = shared_sandbox().compile(source)
        self.source = source
        self.name = name  # where it came from: "model", "file", or "family:<name>" (shown by /v1/models)
        # Templates that read `tools` get them; others get the default convention's plain turns (tool_prompt.py).
        self.reads_tools = "tools" in source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None) -> str:
        """The prompt for `messages`; `tools` (OpenAI's function definitions) go to templates that read them;
        `extra` are further template variables (a request's chat_template_kwargs), never replacing these."""
        uses_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        if uses_tools and not self.reads_tools:
            messages, tools = as_plain_turns(list(messages), list(tools) if tools else None), None
        arguments = {
            **(extra or {}),
            "messages": list(messages),
            "tools": list(tools) if tools else None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        return shared_sandbox().render(self._digest, self.source, arguments)
