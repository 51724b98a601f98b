"""One Ollama answer: a job's events framed as Ollama's JSON lines, or as one object.

Apart from the routes (ollama.py), which turn a chat or a prompt into a job: here the job
runs and its text is split (thinking, content, tool calls with arguments as objects), its
log-probabilities attached and its counts and durations reported, the same for /api/chat
and /api/generate.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from llorch.api.generation import CLIENT_CLOSED_REQUEST, unless_disconnected
from llorch.api.jobs import JobStream
from llorch.api.json_answer import json_answer
from llorch.api.ollama_errors import job_error, refusal
from llorch.api.ollama_schemas import GenerationBody
from llorch.api.socket_body import socket_body
from llorch.api.streaming import NDJSON
from llorch.api.tool_calls import ToolFormat
from llorch.api.turn import Piece, Turn
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import End, Error, Event, GenerationRequest, Started, TokenLogprob, TokenText

DONE_REASONS = {"MAX_TOKENS": "length", "EOS": "stop", "STOP_SEQUENCE": "stop"}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass
class Reply:
    """The turn's text, split as it streams (turn.py), in Ollama's shape: call arguments as objects."""

    turn: Turn
    whole: Piece = field(default_factory=Piece)

    def feed(self, text: str) -> Piece:
        return self._add(self.turn.take(text))

    def finish(self) -> Piece:
        return self._add(self.turn.take("", end=True))

    def _add(self, split: Piece) -> Piece:
        first = len(self.whole.calls)
        calls = [ollama_call(call, first + i) for i, call in enumerate(split.calls)]
        piece = Piece(split.reasoning, split.content, calls)
        self.whole.reasoning += piece.reasoning
        self.whole.content += piece.content
        self.whole.calls.extend(piece.calls)
        return piece


def ollama_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """A parsed call in Ollama's shape: arguments as an object."""
    function = call["function"]
    return {"id": call["id"], "function": {"index": index, "name": function["name"],
                                           "arguments": json.loads(function["arguments"])}}


def ollama_logprob(entry: TokenLogprob, top: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"token": entry.token, "logprob": entry.logprob,
                            "bytes": list(entry.token.encode("utf-8", "replace"))}
    if top:
        body["top_logprobs"] = [{"token": text, "logprob": value, "bytes": list(text.encode("utf-8", "replace"))}
                                for _, text, value in entry.top]
    return body


@dataclass
class Clock:
    """When the request came, its job was accepted, its first token arrived and it ended (nanoseconds)."""

    start: int = field(default_factory=time.perf_counter_ns)
    accepted: int | None = None
    first: int | None = None
    end: int | None = None

    def mark(self, event: Event) -> None:
        at = time.perf_counter_ns()
        if isinstance(event, Started) and self.accepted is None:
            self.accepted = at
        elif isinstance(event, TokenText | TokenLogprob) and self.first is None:
            self.first = at
        elif isinstance(event, End):
            self.end = at
            self.first = self.first or at

    def stats(self, prompt_tokens: int, end: End, turn_finished: bool = False) -> dict[str, Any]:
        """Ollama's counts and durations: the prompt is read from acceptance to the first token. A finished
        turn (a repeated call, cancelled) may still reach max_tokens before the cancel lands: it stopped."""
        finish = self.end or time.perf_counter_ns()
        accepted = self.accepted or self.start
        first = self.first or finish
        reason = "stop" if turn_finished else DONE_REASONS.get(end.stop_reason.value, "stop")
        return {"done_reason": reason, "total_duration": finish - self.start,
                "load_duration": 0, "prompt_eval_count": prompt_tokens, "prompt_eval_duration": first - accepted,
                "eval_count": end.tokens_out, "eval_duration": finish - first}


@dataclass
class Shape:
    """Ollama's answer objects: a chat's carry a message, a generation's a response text."""

    kind: Literal["chat", "generate"]
    model: str
    top_logprobs: bool = False

    def body(self, piece: Piece, logprobs: list[TokenLogprob], done: bool) -> dict[str, Any]:
        answer: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": piece.content}
            if piece.reasoning:
                message["thinking"] = piece.reasoning
            if piece.calls:
                message["tool_calls"] = piece.calls
            answer["message"] = message
        else:
            answer["response"] = piece.content
            if piece.reasoning:
                answer["thinking"] = piece.reasoning
        if logprobs:
            answer["logprobs"] = [ollama_logprob(entry, self.top_logprobs) for entry in logprobs]
        answer["done"] = done
        return answer

    def loaded(self) -> dict[str, Any]:
        """Ollama's answer to a request with nothing to generate: the model is loaded."""
        return {**self.body(Piece(), [], done=True), "done_reason": "load"}


def ndjson(body: dict[str, Any]) -> bytes:
    return (json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


async def answer(http: Request, engine: Engine, request: GenerationRequest, body: GenerationBody, shape: Shape,
                 tool_format: ToolFormat | None, templated: bool) -> Response:
    """Run one job and frame its events as Ollama's answer, streamed or whole."""
    clock = Clock()
    try:
        job = await run_in_threadpool(engine.prepare, replace(request, job_id=f"ollama-{uuid.uuid4().hex}"))
        stream = JobStream(engine, job)
    except EngineRefusal as exc:
        raise refusal(exc) from exc
    # A raw prompt is not a chat turn: nothing is split off it.
    reply = Reply(Turn.for_chat(engine, job, tool_format) if templated else Turn())
    prompt_tokens = len(job.prompt_ids)
    if body.stream:
        lines = Lines(stream, reply, clock, shape, prompt_tokens)
        return StreamingResponse(stream.frames(lines.event, socket_body(http)), media_type=NDJSON,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collected: list[TokenLogprob] = []
    ended: list[End] = []

    async def collect() -> None:
        async for event in stream.events():
            clock.mark(event)
            if isinstance(event, Error):
                raise job_error(event)
            if isinstance(event, TokenLogprob):
                collected.append(event)
            elif isinstance(event, TokenText):
                reply.feed(event.t)
                if reply.turn.finished:  # a repeated call ended the turn
                    engine.cancel(stream.job_id)
            elif isinstance(event, End):
                reply.finish()
                ended.append(event)

    if not await unless_disconnected(http, asyncio.ensure_future(collect())):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the job is cancelled
    return await json_answer(lambda: {**shape.body(reply.whole, collected, done=True),
                                      **clock.stats(prompt_tokens, ended[0], reply.turn.finished)})


class Lines:
    """The streamed answer's JSON lines, one job event's at a time, for the event loop and the engine thread
    alike (jobs.py)."""

    def __init__(self, stream: JobStream, reply: Reply, clock: Clock, shape: Shape, prompt_tokens: int) -> None:
        self.stream, self.reply, self.clock, self.shape, self.prompt_tokens = stream, reply, clock, shape, prompt_tokens
        self.pending: list[TokenLogprob] = []  # log-probabilities wait for the text they belong to

    def event(self, event: Event) -> bytes:
        reply, shape = self.reply, self.shape
        self.clock.mark(event)
        out = []
        if isinstance(event, Error):
            out.append(ndjson({"error": job_error(event).message}))
        elif isinstance(event, TokenLogprob):
            self.pending.append(event)
        elif isinstance(event, TokenText):
            piece = reply.feed(event.t)
            if reply.turn.finished:  # a repeated call ended the turn
                self.stream.engine.cancel(self.stream.job_id)
            if piece:
                out.append(ndjson(shape.body(piece, self.pending, done=False)))
                self.pending = []
        elif isinstance(event, End):
            piece = reply.finish()
            if piece:
                out.append(ndjson(shape.body(piece, self.pending, done=False)))
                self.pending = []
            stats = self.clock.stats(self.prompt_tokens, event, reply.turn.finished)
            out.append(ndjson({**shape.body(Piece(), self.pending, done=True), **stats}))
        return b"".join(out)

