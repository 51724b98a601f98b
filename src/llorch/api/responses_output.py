"""A Responses API response object, its output items and the stream events that build them.

Apart from the routes (responses.py), which run the job and store the result: this is the
job's text turned into OpenAI's shapes, the same code for a streamed response and a whole one.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from llorch.api.errors import openai_job_error
from llorch.api.responses_schemas import ResponseRequest
from llorch.api.turn import Piece, Turn
from llorch.engine.request import End, Error, StopReason, TokenText


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def skeleton(response_id: str, model: str, body: ResponseRequest) -> dict[str, Any]:
    """The response object before any output: the request's settings echoed as OpenAI's clients read them."""
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "completed_at": None, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {}, "model": model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                      "summary": body.reasoning.summary if body.reasoning else None},
        "service_tier": "default", "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature, "text": body.echoed_text(),
        "tool_choice": body.echoed_tool_choice(), "tools": [t.echoed() for t in body.tools or []],
        "top_logprobs": 0, "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "usage": None, "user": body.user,
    }


class OutputBuilder:
    """A job's text as output items, and the stream events that build them, in order.

    Thoughts (when the model thinks) make a reasoning item; text a message; each tool call
    a function_call item. Text that is only white space opens no message until more comes:
    before a call it is dropped, as chat completions drop it.
    """

    def __init__(self, response: dict[str, Any], turn: Turn, input_tokens: int) -> None:
        self.response = response
        self.turn = turn
        self.input_tokens = input_tokens
        self.sequence = 0
        self.open: dict[str, Any] | None = None  # the message or reasoning item being written
        self.held = ""  # white space not yet sent
        self.reasoning_tokens = 0
        self.answering = turn.reasoning is None  # whether the thought (if any) has ended

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.response)

    def started(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def feed(self, event: Any) -> list[dict[str, Any]]:
        if isinstance(event, TokenText):
            return self.text(event.t)
        if isinstance(event, End):
            return self.finish(event)
        return []

    def text(self, text: str) -> list[dict[str, Any]]:
        piece = self.turn.take(text)
        if not self.answering:  # tokens before the first of the answer (counted when there was a thought)
            self.answering = bool(piece.content or piece.calls)
            self.reasoning_tokens += not self.answering
        return self.render(piece)

    def render(self, piece: Piece) -> list[dict[str, Any]]:
        events = self.think(piece.reasoning) + self.say(piece.content)
        for call in piece.calls:
            events += self.call(call)
        return events

    def think(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events = self.close()
            events += self.start({"id": new_id("rs"), "type": "reasoning", "summary": [],
                                  "content": [{"type": "reasoning_text", "text": ""}]})
        return events + self.append(text, "response.reasoning_text.delta")

    def say(self, text: str, force: bool = False) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "message":
            self.held += text
            if not self.held.strip() and not force:
                return []
            events = self.close()
            events += self.start({"id": new_id("msg"), "type": "message", "role": "assistant",
                                  "content": [{"type": "output_text", "text": "", "annotations": []}]})
            text, self.held = self.held, ""
        if not text:
            return events
        return events + self.append(text, "response.output_text.delta", logprobs=[])

    def start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A message or reasoning item begins: added (empty), then its one content part."""
        item["status"] = "in_progress"
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        added = {**item, "content": []}
        return [self.event("response.output_item.added", output_index=index, item=copy.deepcopy(added)),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=copy.deepcopy(item["content"][0]))]

    def append(self, text: str, kind: str, **extra: Any) -> list[dict[str, Any]]:
        assert self.open is not None
        self.open["content"][0]["text"] += text
        return [self.event(kind, item_id=self.open["id"], output_index=len(self.output) - 1, content_index=0,
                           delta=text, **extra)]

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index, part = len(self.output) - 1, item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            done = self.event("response.output_text.done", **where, text=part["text"], logprobs=[])
        else:
            done = self.event("response.reasoning_text.done", **where, text=part["text"])
        return [done, self.event("response.content_part.done", **where, part=copy.deepcopy(part)),
                self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.held = ""  # white space before a call is not an answer
        function = call["function"]
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"], "status": "completed"}
        self.output.append(item)
        index = len(self.output) - 1
        return [
            *events,
            self.event("response.output_item.added", output_index=index,
                       item={**item, "arguments": "", "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=item["arguments"]),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def finish(self, end: End) -> list[dict[str, Any]]:
        events = self.render(self.turn.take("", end=True))
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            events += self.say("", force=True)  # every answer has a message, if nothing else
        # A finished turn (a repeated call, cancelled) may still reach max_tokens before the cancel lands.
        cut = end.stop_reason is StopReason.MAX_TOKENS and not self.turn.finished
        events += self.close("incomplete" if cut else "completed")
        self.response.update({
            "status": "incomplete" if cut else "completed", "completed_at": None if cut else int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0,
                                                                                 "cache_write_tokens": 0},
                      "output_tokens": end.tokens_out,
                      "output_tokens_details": {"reasoning_tokens": self.thought_tokens(end)},
                      "total_tokens": self.input_tokens + end.tokens_out}})
        kind = "response.incomplete" if cut else "response.completed"
        return [*events, self.event(kind, response=self.snapshot())]

    def thought_tokens(self, end: End) -> int:
        thought = any(item["type"] == "reasoning" for item in self.output)
        return min(self.reasoning_tokens, end.tokens_out) if thought else 0

    def failed(self, error: Error) -> list[dict[str, Any]]:
        """The job ended in an error: an `error` event, then the response as failed."""
        status = openai_job_error(error)
        events = self.close("incomplete")
        self.response.update({"status": "failed", "error": {"code": "server_error", "message": error.message}})
        return [*events, self.event("error", code=status.code, message=error.message, param=None),
                self.event("response.failed", response=self.snapshot())]
