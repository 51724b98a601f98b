"""What an OpenAI request's choices hold while their jobs run, and the two response shapes that carry them.

A Choice gathers one job's events (text, log-probabilities, the chat turn's reasoning and
tool calls); CompletionShape and ChatShape turn choices into /v1/completions' and
/v1/chat/completions' bodies and stream chunks, behind one ResponseShape protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from llorch.api.turn import Turn
from llorch.engine.request import End, Event, PromptLogprobs, TokenLogprob, TokenText

FINISH_REASONS = {"MAX_TOKENS": "length", "EOS": "stop", "STOP_SEQUENCE": "stop"}


@dataclass(frozen=True)
class UnscoredToken:
    """An echoed prompt's first token: nothing comes before it, so it has no log-probability."""

    token_id: int
    token: str


LogprobEntry = TokenLogprob | UnscoredToken


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    text: str = ""
    logprobs: list[LogprobEntry] = field(default_factory=list)
    end: End | None = None
    streamed_logprobs: int = 0  # how many of `logprobs` a stream has sent
    text_offset: int = 0  # characters of text a stream has sent (text_offset of its next entry)
    turn: Turn | None = None  # a chat turn: splits text into reasoning, content and calls
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    echo: str | None = None  # the prompt's text still to put in front (`echo`; taken by the first text)

    def unsent_logprobs(self) -> list[LogprobEntry]:
        entries = self.logprobs[self.streamed_logprobs :]
        self.streamed_logprobs = len(self.logprobs)
        return entries

    def take_echo(self) -> str:
        """The echoed prompt's text, once; its log-probabilities are already first in `logprobs`."""
        echo, self.echo = self.echo, None
        return echo or ""

    @property
    def finish_reason(self) -> str | None:
        if self.end is None:
            return None
        # A finished turn (a repeated call, cancelled) may still reach max_tokens before the cancel lands.
        finished = self.turn is not None and self.turn.finished
        if self.tool_calls and (self.end.stop_reason.value != "MAX_TOKENS" or finished):
            return "tool_calls"
        return FINISH_REASONS.get(self.end.stop_reason.value)


def absorb(choice: Choice, event: Event, keep_text: bool = True) -> str:
    """Record an event in its choice; return the new text it carries (kept in `text` unless a turn splits it)."""
    if isinstance(event, TokenText):
        if keep_text:
            choice.text += event.t
        return event.t
    if isinstance(event, TokenLogprob):
        choice.logprobs.append(event)
    elif isinstance(event, PromptLogprobs):
        choice.logprobs.extend(event.entries)
    elif isinstance(event, End):
        choice.end = event
    return ""


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(c.end.tokens_out for c in choices if c.end)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def tool_call_deltas(index: int, call: dict[str, Any]) -> list[dict[str, Any]]:
    """A call as stream deltas, the way OpenAI sends them: id, type and name first, then the arguments."""
    function = call["function"]
    return [{"index": index, "id": call["id"], "type": "function", "function": {"name": function["name"],
                                                                                  "arguments": ""}},
            {"index": index, "function": {"arguments": function["arguments"]}}]


class ResponseShape(Protocol):
    """How choices go on the wire: a whole response, or stream chunks."""

    def envelope(self) -> dict[str, Any]: ...
    def response(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]: ...
    def finish(self, choice: Choice) -> str | None: ...
    def first_chunk(self, index: int) -> dict[str, Any] | None: ...
    def chunk(self, choice: Choice, text: str, entries: list[LogprobEntry], finish: str | None = None
              ) -> dict[str, Any]: ...
    def reasoning_chunk(self, index: int, reasoning: str) -> dict[str, Any]: ...
    def tool_chunk(self, index: int, call_delta: dict[str, Any]) -> dict[str, Any]: ...


def token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "replace"))


@dataclass
class CompletionShape:
    id: str
    created: int
    model: str
    special_ids: frozenset[int] = frozenset()  # tokens the text leaves out (BOS, say): they take no characters

    def text_length(self, entry: LogprobEntry) -> int:
        return 0 if entry.token_id in self.special_ids else len(entry.token)

    def envelope(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def logprobs(self, entries: list[LogprobEntry], offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs object; `offset` is where the first entry's text starts in the completion."""
        if not entries:
            return None
        offsets, position = [], offset
        for e in entries:
            offsets.append(position)
            position += self.text_length(e)
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [e.logprob if isinstance(e, TokenLogprob) else None for e in entries],
                "top_logprobs": [{tok: lp for _, tok, lp in e.top} if isinstance(e, TokenLogprob) else None
                                 for e in entries],
                "text_offset": offsets}

    def response(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        return {**self.envelope(), "choices": [
            {"index": c.index, "text": c.text, "logprobs": self.logprobs(c.logprobs),
             "finish_reason": c.finish_reason} for c in choices], "usage": usage}

    @staticmethod
    def finish(choice: Choice) -> str | None:
        return choice.finish_reason

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        return None

    def chunk(self, choice: Choice, text: str, entries: list[LogprobEntry], finish: str | None = None
              ) -> dict[str, Any]:
        logprobs = self.logprobs(entries, choice.text_offset)
        choice.text_offset += sum(self.text_length(e) for e in entries)
        return {**self.envelope(), "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                                "finish_reason": finish}]}


@dataclass
class ChatShape:
    id: str
    created: int
    model: str
    legacy_functions: bool = False  # the request used `functions`: a call is answered as `function_call`

    def finish(self, choice: Choice) -> str | None:
        reason = choice.finish_reason
        return "function_call" if reason == "tool_calls" and self.legacy_functions else reason

    def envelope(self, chunk: bool = True) -> dict[str, Any]:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def logprobs(entries: list[LogprobEntry]) -> dict[str, Any] | None:
        entries = [e for e in entries if isinstance(e, TokenLogprob)]  # chat has no echo
        if not entries:
            return None
        return {"content": [{
            "token": e.token, "logprob": e.logprob, "bytes": token_bytes(e.token),
            "top_logprobs": [{"token": tok, "logprob": lp, "bytes": token_bytes(tok)} for _, tok, lp in e.top],
        } for e in entries]}

    def response(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        return {**self.envelope(chunk=False), "choices": [
            {"index": c.index, "message": self.message(c), "logprobs": self.logprobs(c.logprobs),
             "finish_reason": self.finish(c)} for c in choices],
            "usage": usage}

    def message(self, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if choice.reasoning:
            message["reasoning_content"] = choice.reasoning
        if choice.tool_calls:
            message["content"] = choice.text if choice.text.strip() else None
            if self.legacy_functions:
                message["function_call"] = choice.tool_calls[0]["function"]
            else:
                message["tool_calls"] = choice.tool_calls
        return message

    def delta_chunk(self, index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {**self.envelope(), "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                "finish_reason": None}]}

    def tool_chunk(self, index: int, call_delta: dict[str, Any]) -> dict[str, Any]:
        if self.legacy_functions:
            return self.delta_chunk(index, {"function_call": call_delta["function"]})
        return self.delta_chunk(index, {"tool_calls": [call_delta]})

    def reasoning_chunk(self, index: int, reasoning: str) -> dict[str, Any]:
        return self.delta_chunk(index, {"reasoning_content": reasoning})

    def first_chunk(self, index: int) -> dict[str, Any]:
        return {**self.envelope(), "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}

    def chunk(self, choice: Choice, text: str, entries: list[LogprobEntry], finish: str | None = None
              ) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {**self.envelope(), "choices": [{"index": choice.index, "delta": delta,
                                                "logprobs": self.logprobs(entries), "finish_reason": finish}]}
