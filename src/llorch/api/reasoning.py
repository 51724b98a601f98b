"""Reasoning: a model that thinks before it answers gets its thoughts split from its answer.

Models such as Qwen3 and the DeepSeek-R1 distills write `<think> ... </think>` and then the
answer. Their chat templates say so, so the markers are chosen from the template's text.
Many such templates open the thought in the generation prompt themselves (the prompt ends
with `<think>`); then the model's first token is already inside it. The APIs put the
thoughts in their own field: `reasoning_content` in chat completions, reasoning items in
Responses, thinking blocks in Anthropic Messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from llorch.api.tool_calls import partial_suffix

# (opening, closing) markers, in the order they are looked for in a template.
REASONING_MARKERS: tuple[tuple[str, str], ...] = (("<think>", "</think>"),)


def reasoning_markers(template_source: str | None) -> tuple[str, str] | None:
    """The thought markers a chat template uses, or None for a model that does not think aloud."""
    if not template_source:
        return None
    for start, end in REASONING_MARKERS:
        if start in template_source and end in template_source:
            return start, end
    return None


@dataclass
class ReasoningParser:
    """Splits generated text, as it streams, into reasoning and content.

    Only the start of the output may open a thought (after white space); once it closes, the
    rest is content. Text that might be the start of a marker is held back until it is not.
    """

    start: str
    end: str
    in_reasoning: bool = False  # the prompt opened the thought already
    _buffer: str = ""
    _decided: bool = False  # whether the start of the output has been seen
    _closed: bool = False  # the thought has ended: white space before the answer is dropped

    @classmethod
    def for_prompt(cls, markers: tuple[str, str], prompt: str) -> ReasoningParser:
        start, end = markers
        opened = prompt.rstrip().endswith(start)
        return cls(start, end, in_reasoning=opened, _decided=opened)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` adds and that can be sent now."""
        self._buffer += text
        reasoning = ""
        if not self._decided:
            stripped = self._buffer.lstrip()
            if len(stripped) < len(self.start) and self.start.startswith(stripped):
                return "", ""  # could still be the opening marker
            self._decided = True
            if stripped.startswith(self.start):
                self.in_reasoning, self._buffer = True, stripped[len(self.start):]
        if self.in_reasoning:
            at = self._buffer.find(self.end)
            if at < 0:
                cut = len(self._buffer) - partial_suffix(self._buffer, self.end)
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:at], self._buffer[at + len(self.end):]
            self.in_reasoning, self._closed = False, True
        if self._closed:  # the answer starts at its first visible character
            self._buffer = self._buffer.lstrip()
            self._closed = not self._buffer
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the end: a thought cut short stays reasoning."""
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self.in_reasoning else ("", rest.lstrip() if self._closed else rest)
