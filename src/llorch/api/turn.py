"""One generated assistant turn, split as it streams into reasoning, content and tool calls.

Every chat-shaped API (chat completions, Responses, Anthropic Messages, Ollama) reads the
model's text through one of these: the reasoning parser takes the thought off the front
(when the model thinks), and the tool-call parser splits what follows into content and
calls (when tools are in play).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llorch.api.reasoning import ReasoningParser, reasoning_markers
from llorch.api.tool_calls import ToolCallParser, ToolFormat
from llorch.engine.engine import Engine
from llorch.engine.request import PreparedJob


@dataclass
class Piece:
    """What some text of the turn adds: thought, answer text and completed calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class Turn:
    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None

    @classmethod
    def for_chat(cls, engine: Engine, job: PreparedJob, tool_format: ToolFormat | None) -> Turn:
        """The splitters a chat job's output needs: reasoning when the template thinks, calls when tools may be
        called. `job` is prepared: its prompt is the rendered conversation."""
        template = engine.chat_template
        markers = reasoning_markers(template.source if template else None)
        parser = ReasoningParser.for_prompt(markers, job.request.prompt or "") if markers else None
        return cls(parser, ToolCallParser(tool_format) if tool_format else None)

    @property
    def finished(self) -> bool:
        """The model repeated a call: the turn is over, and its job should be cancelled."""
        return self.tools is not None and self.tools.finished

    def take(self, text: str, end: bool = False) -> Piece:
        """What `text` adds and can be sent now; with `end`, also everything held back (the turn is over)."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if end and self.reasoning:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return self._content(reasoning, content, end)

    def _content(self, reasoning: str, content: str, end: bool) -> Piece:
        if self.tools is None:
            return Piece(reasoning, content)
        content, calls = self.tools.feed(content)
        if end:
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
        return Piece(reasoning, content, calls)
