"""Anthropic Messages API: /v1/messages and /v1/messages/count_tokens.

A request becomes one engine job through the same front door as the OpenAI chat path:
its conversation is turned into the chat template's messages (tool_use blocks into
assistant tool calls, tool_result blocks into tool messages), its tools into the
OpenAI-shaped list the template and the tool grammar read. The answer's text is split
into content blocks as it streams (thinking, text, tool_use); a whole answer is the
same blocks, collected. Errors answer in Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from llorch.api.anthropic_schemas import CountTokensRequest, MessagesInput, MessagesRequest
from llorch.api.body import BadRequest, read_json, request_body
from llorch.api.errors import ANTHROPIC_ERROR_SCHEMA, RETRY, AnthropicError, error_responses
from llorch.api.generation import CLIENT_CLOSED_REQUEST, tool_constraint, unless_disconnected
from llorch.api.jobs import JobStream
from llorch.api.json_answer import json_answer
from llorch.api.socket_body import SocketBody, socket_body
from llorch.api.state import WorkerState
from llorch.api.streaming import SSE, sse
from llorch.api.tool_calls import ToolFormat
from llorch.api.turn import Piece, Turn
from llorch.api.violations import one_message
from llorch.engine.engine import Engine
from llorch.engine.errors import DuplicateJob, EngineRefusal, QueueFull, RequestRejected
from llorch.engine.request import End, Error, ErrorCode, Event, GenerationRequest, PreparedJob, StopReason, TokenText

Body = TypeVar("Body", bound=BaseModel)
OPENAPI_MODELS: tuple[type[BaseModel], ...] = (MessagesRequest, CountTokensRequest)

# A cancelled job has no Anthropic reason of its own: what it wrote is a finished, if short, turn.
STOP_REASONS = {StopReason.EOS: "end_turn", StopReason.MAX_TOKENS: "max_tokens",
                StopReason.STOP_SEQUENCE: "stop_sequence", StopReason.CANCELLED: "end_turn"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_ERRORS = {400: "Invalid or unsupported parameters", 401: "Missing or wrong API key", 413: "Body too large",
           503: "Loading, draining or busy (Retry-After)"}
MESSAGES_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "A message, or its events when stream=true",
          "content": {"application/json": {"schema": {"type": "object"}},
                      SSE: {"schema": {"type": "object", "required": ["event", "data"], "properties": {
                          "event": {"type": "string"}, "data": {"type": "string"}}}}}},
    **error_responses(ANTHROPIC_ERROR_SCHEMA, {**_ERRORS, 500: "Generation failed"}),
}
COUNT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The prompt's token count", "content": {"application/json": {"schema": {
        "type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}}}}},
    **error_responses(ANTHROPIC_ERROR_SCHEMA, _ERRORS),
}


def ready(state: WorkerState) -> Engine:
    why = state.unavailable()
    if why or state.engine is None:
        raise AnthropicError(503, why or "unavailable", headers=RETRY)
    return state.engine


async def parse_body(request: Request, model: type[Body], state: WorkerState) -> tuple[Body, Engine]:
    """The validated body and the engine, or the AnthropicError saying what is wrong."""
    try:
        raw = await read_json(request)
    except BadRequest as exc:  # not JSON, or too large
        raise AnthropicError(exc.status, exc.errors[0]["message"]) from exc
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        raise AnthropicError(400, one_message(exc)[1]) from exc
    return body, ready(state)


def refusal(exc: EngineRefusal) -> AnthropicError:
    if isinstance(exc, RequestRejected):
        return AnthropicError(400, f"{exc.field}: {exc.message}")
    if isinstance(exc, QueueFull):
        return AnthropicError(503, f"The worker is busy: {exc}. Retry shortly.", headers=RETRY)
    if isinstance(exc, DuplicateJob):  # ids are random: a collision is the server's fault
        return AnthropicError(500, "job id collision")
    raise TypeError(f"unmapped refusal {type(exc).__name__}")


def job_error(event: Error) -> AnthropicError:
    if event.code is ErrorCode.VRAM_OOM:
        return AnthropicError(503, f"Out of memory: {event.message}")
    if event.code is ErrorCode.CANCELLED:  # draining: another worker can take it
        return AnthropicError(503, f"The job was cancelled: {event.message}", headers=RETRY)
    return AnthropicError(500, f"{event.code.value}: {event.message}")


def template_request(body: MessagesInput, job_id: str, max_tokens: int, **fields: Any) -> GenerationRequest:
    tools = body.openai_tools()
    return GenerationRequest(job_id, None, max_tokens, messages=tuple(body.template_messages()),
                             tools=tuple(tools) if tools else None, **fields)


async def prepare(engine: Engine, request: GenerationRequest) -> PreparedJob:
    try:
        return await run_in_threadpool(engine.prepare, request)
    except EngineRefusal as exc:
        raise refusal(exc) from exc


def create_anthropic_router(state: WorkerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/messages", response_model=None, openapi_extra=request_body(MessagesRequest),
                 responses=MESSAGES_RESPONSES)
    async def messages(request: Request) -> JSONResponse | StreamingResponse | Response:
        try:
            body, engine = await parse_body(request, MessagesRequest, state)
            return await answer(request, engine, body)
        except AnthropicError as exc:
            return exc.response()

    @router.post("/messages/count_tokens", response_model=None, openapi_extra=request_body(CountTokensRequest),
                 responses=COUNT_RESPONSES)
    async def count_tokens(request: Request) -> dict[str, int] | JSONResponse:
        try:
            body, engine = await parse_body(request, CountTokensRequest, state)
            # Through the front door like a job (rendered, tokenized, sized), but never submitted.
            prepared = await prepare(engine, template_request(body, f"count-{uuid.uuid4().hex}", 1))
        except AnthropicError as exc:
            return exc.response()
        return {"input_tokens": len(prepared.prompt_ids)}

    return router


async def answer(http: Request, engine: Engine, body: MessagesRequest) -> JSONResponse | StreamingResponse | Response:
    message_id = f"msg_{uuid.uuid4().hex}"
    tools = body.openai_tools()
    fmt: ToolFormat | None = None
    constraint = body.format_constraint()
    if tools and body.tool_mode is not None:
        fmt, constraint = tool_constraint(engine, tools, body.tool_mode, body.parallel_tool_calls)
    prepared = await prepare(engine, template_request(body, message_id, body.max_tokens, sampling=body.sampling(),
                                                      stop=tuple(body.stop_sequences or ()), constraint=constraint))
    try:
        stream = JobStream(engine, prepared)
    except EngineRefusal as exc:
        raise refusal(exc) from exc
    builder = Blocks(Turn.for_chat(engine, prepared, fmt if body.tool_mode != "none" else None))
    head = {"id": message_id, "type": "message", "role": "assistant", "model": engine.model_id}
    input_tokens = len(prepared.prompt_ids)
    if body.stream:
        return StreamingResponse(stream_events(stream, builder, head, input_tokens, socket_body(http)),
                                 media_type=SSE, headers=SSE_HEADERS)
    ended: list[End] = []

    async def collect() -> None:
        async for event in stream.events():
            if isinstance(event, TokenText):
                builder.feed(event.t)
                if builder.finished:
                    engine.cancel(stream.job_id)
            elif isinstance(event, End):
                builder.finish()
                ended.append(event)
            elif isinstance(event, Error):
                raise job_error(event)

    if not await unless_disconnected(http, asyncio.ensure_future(collect())):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the job is cancelled
    end = ended[0]
    return await json_answer(lambda: {**head, "content": builder.blocks, **builder.stop(end),
                                      "usage": {"input_tokens": input_tokens, "output_tokens": end.tokens_out}})


def event_frames(stream: JobStream, builder: Blocks, event: Event) -> bytes:
    """One job event's server-sent events, for the event loop and the engine thread alike (jobs.py)."""
    out: list[bytes] = []
    if isinstance(event, TokenText):
        out.extend(sse(payload, name) for name, payload in builder.feed(event.t))
        if builder.finished:  # the rest would be discarded
            stream.engine.cancel(stream.job_id)
    elif isinstance(event, End):
        out.extend(sse(payload, name) for name, payload in builder.finish())
        out.append(sse({"type": "message_delta", "delta": builder.stop(event),
                        "usage": {"output_tokens": event.tokens_out}}, "message_delta"))
        out.append(sse({"type": "message_stop"}, "message_stop"))
    elif isinstance(event, Error):
        out.append(sse(job_error(event).body(), "error"))
    return b"".join(out)


async def stream_events(stream: JobStream, builder: Blocks, head: dict[str, Any], input_tokens: int,
                        direct: SocketBody | None) -> AsyncIterator[bytes]:
    start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
    yield sse({"type": "message_start", "message": start}, "message_start") + sse({"type": "ping"}, "ping")
    async for data in stream.frames(lambda event: event_frames(stream, builder, event), direct):
        yield data


StreamEvent = tuple[str, dict[str, Any]]


@dataclass
class Blocks:
    """The content blocks of one answer, built as its text arrives, with the stream events that build them.

    The turn splits the text: reasoning (when the model thinks) becomes thinking blocks,
    completed tool calls tool_use blocks, the rest text blocks. White space is held back
    until text follows it, so a turn that is only calls has no empty text block before them.
    """

    turn: Turn
    blocks: list[dict[str, Any]] = field(default_factory=list)
    _open: str | None = None  # the type of the last block while it is still being written
    _pending: str = ""  # white space not yet in a text block

    @property
    def finished(self) -> bool:
        """The turn ended early (a repeated tool call): its job should be cancelled."""
        return self.turn.finished

    def feed(self, text: str) -> list[StreamEvent]:
        return self._add(self.turn.take(text))

    def finish(self) -> list[StreamEvent]:
        events = self._add(self.turn.take("", end=True))
        if self._pending and not any(block["type"] == "tool_use" for block in self.blocks):
            events += self._start({"type": "text", "text": ""}) + self._delta("text", self._pending)
        return events + self._close()

    def stop(self, end: End) -> dict[str, Any]:
        """stop_reason and stop_sequence of the finished answer."""
        called = any(block["type"] == "tool_use" for block in self.blocks)
        reason = STOP_REASONS[end.stop_reason]
        # A finished turn (a repeated call, cancelled) may still reach max_tokens before the cancel lands.
        if called and (end.stop_reason is not StopReason.MAX_TOKENS or self.finished):
            reason = "tool_use"
        return {"stop_reason": reason, "stop_sequence": end.stop_sequence_matched}

    def _add(self, piece: Piece) -> list[StreamEvent]:
        events = self._thinking(piece.reasoning) if piece.reasoning else []
        return events + self._text(piece.content) + self._tool_uses(piece.calls)

    def _thinking(self, text: str) -> list[StreamEvent]:
        events = [] if self._open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
        return events + self._delta("thinking", text)

    def _text(self, text: str) -> list[StreamEvent]:
        if not text:
            return []
        if self._open == "text":
            return self._delta("text", text)
        self._pending += text
        if not self._pending.strip():
            return []
        text, self._pending = self._pending, ""
        return self._start({"type": "text", "text": ""}) + self._delta("text", text)

    def _tool_uses(self, calls: list[dict[str, Any]]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for call in calls:
            self._pending = ""  # white space between blocks is nobody's text
            function = call["function"]
            events += self._start({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                                   "name": function["name"], "input": {}})
            self.blocks[-1]["input"] = json.loads(function["arguments"])
            events.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                   "delta": {"type": "input_json_delta",
                                                             "partial_json": function["arguments"]}}))
            events += self._close()
        return events

    def _start(self, block: dict[str, Any]) -> list[StreamEvent]:
        events = self._close()
        self.blocks.append(block)
        self._open = block["type"]
        start = {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}
        return [*events, ("content_block_start", start)]

    def _delta(self, kind: str, text: str) -> list[StreamEvent]:
        self.blocks[-1][kind] += text
        return [("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                         "delta": {"type": f"{kind}_delta", kind: text}})]

    def _close(self) -> list[StreamEvent]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]
