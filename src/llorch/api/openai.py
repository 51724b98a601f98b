"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

A request goes through the engine's front door once (chat messages are rendered
there); each of its n choices is one engine job, submitted through the same
JobStream as the worker API: one generation path, two wire formats.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from llorch.api.body import BadRequest, read_json
from llorch.api.errors import (
    OPENAI_ERROR_SCHEMA,
    OpenAIError,
    error_responses,
    openai_job_error,
    openai_refusal,
)
from llorch.api.jobs import JobStream
from llorch.api.openai_schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from llorch.api.state import WorkerState
from llorch.api.streaming import sse
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import End, Error, Event, GenerationRequest, TokenLogprob, TokenText

FINISH_REASONS = {"MAX_TOKENS": "length", "EOS": "stop", "STOP_SEQUENCE": "stop"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    end: End | None = None
    streamed_logprobs: int = 0  # how many of `logprobs` a stream has sent

    def unsent_logprobs(self) -> list[TokenLogprob]:
        entries = self.logprobs[self.streamed_logprobs :]
        self.streamed_logprobs = len(self.logprobs)
        return entries

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.end.stop_reason.value) if self.end else None


GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "A completion, or its chunks when stream=true",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
                          "data": {"type": "string"}}}}}},
    **error_responses(OPENAI_ERROR_SCHEMA, {
        400: "Invalid or unsupported parameters", 401: "Missing or wrong API key", 404: "Unknown model",
        413: "Body too large", 500: "Generation failed", 503: "Loading, draining or out of memory"}),
}


def request_body(model: type[OpenAIRequest]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def openapi_components() -> dict[str, Any]:
    """JSON schemas of the OpenAI request bodies, for the app's OpenAPI document."""
    components: dict[str, Any] = {}
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    return components


def ready(state: WorkerState) -> Engine:
    """The engine, or a 503 while the worker loads or drains."""
    why = state.unavailable()
    if why or state.engine is None:
        raise OpenAIError(503, why or "unavailable", kind="server_error", code="unavailable")
    return state.engine


def create_openai_router(state: WorkerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models", response_model=None, responses=error_responses(OPENAI_ERROR_SCHEMA, {503: "Loading"}))
    async def models() -> dict[str, Any] | JSONResponse:
        try:
            engine = ready(state)
        except OpenAIError as exc:
            return exc.response()
        return {"object": "list", "data": [{
            "id": engine.model_id, "object": "model", "created": 0, "owned_by": "llorch",
            "context_length": engine.ctx_size, "max_model_len": engine.ctx_size,
        }]}

    @router.post("/completions", response_model=None, openapi_extra=request_body(CompletionRequest),
                 responses=GENERATION_RESPONSES)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        try:
            body = await parse(request, CompletionRequest)
            max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
            job = GenerationRequest("", body.prompt_text, max_tokens, stop=body.stop_sequences, logprobs=body.logprobs)
            return await generate(ready(state), body, job, chat=False)
        except OpenAIError as exc:
            return exc.response()

    @router.post("/chat/completions", response_model=None, openapi_extra=request_body(ChatCompletionRequest),
                 responses=GENERATION_RESPONSES)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        try:
            body = await parse(request, ChatCompletionRequest)
            top = (body.top_logprobs or 0) if body.logprobs else None
            job = GenerationRequest("", None, body.max_completion_tokens or body.max_tokens, stop=body.stop_sequences,
                                    logprobs=top, messages=tuple(m.for_template() for m in body.messages))
            return await generate(ready(state), body, job, chat=True)
        except OpenAIError as exc:
            return exc.response()

    async def parse(request: Request, model: type[OpenAIRequest]) -> Any:
        try:
            raw = await read_json(request)
        except BadRequest as exc:  # not JSON, or too large: the same message in OpenAI's shape
            raise OpenAIError(exc.status, exc.errors[0]["message"]) from exc
        try:
            body = model.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise OpenAIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from exc
        engine = ready(state)  # 503 while loading or draining, before anything else
        if body.model != engine.model_id:
            raise OpenAIError(404, f"The model `{body.model}` does not exist; this worker serves "
                              f"`{engine.model_id}`.", param="model", code="model_not_found")
        return body

    return router


async def generate(engine: Engine, body: Any, request: GenerationRequest, chat: bool
                   ) -> JSONResponse | StreamingResponse:
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    streams: list[JobStream] = []
    try:
        prepared = await run_in_threadpool(engine.prepare, request)
        for i in range(body.n):
            streams.append(JobStream(engine, prepared.for_choice(f"{request_id}-{i}", body.sampling(i))))
    except EngineRefusal as exc:
        for submitted in streams:  # all n choices or none
            engine.cancel(submitted.job_id)
        raise openai_refusal(exc) from exc
    prompt_tokens = len(prepared.prompt_ids)
    created = int(time.time())
    shape = ChatShape(request_id, created, engine.model_id) if chat else CompletionShape(request_id, created,
                                                                                         engine.model_id)
    if body.stream:
        return StreamingResponse(stream_chunks(streams, shape, body.include_usage, prompt_tokens),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    choices = [Choice(i) for i in range(len(streams))]
    async for index, event in merged(streams):
        if isinstance(event, Error):
            raise openai_job_error(event)
        absorb(choices[index], event)
    return JSONResponse(shape.response(choices, usage(prompt_tokens, choices)))


def absorb(choice: Choice, event: Event) -> str:
    """Record an event in its choice; return the new text it carries."""
    if isinstance(event, TokenText):
        choice.text += event.t
        return event.t
    if isinstance(event, TokenLogprob):
        choice.logprobs.append(event)
    elif isinstance(event, End):
        choice.end = event
    return ""


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(c.end.tokens_out for c in choices if c.end)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


async def merged(streams: list[JobStream]) -> AsyncIterator[tuple[int, Event]]:
    """Events of all choices as they come, tagged with the choice index."""
    if len(streams) == 1:
        async for event in streams[0].events():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(index: int, stream: JobStream) -> None:
        async for event in stream.events():
            await queue.put((index, event))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, event = await queue.get()
            if event is None:
                remaining -= 1
            else:
                yield index, event
    finally:
        for task in tasks:  # cancelling a pump cancels its job
            task.cancel()


async def stream_chunks(streams: list[JobStream], shape: Any, include_usage: bool,
                        prompt_tokens: int) -> AsyncIterator[bytes]:
    choices = [Choice(i) for i in range(len(streams))]
    for choice in choices:
        first = shape.first_chunk(choice.index)
        if first:
            yield sse(first)
    async for index, event in merged(streams):
        choice = choices[index]
        if isinstance(event, Error):
            yield sse(openai_job_error(event).body())
            break
        text = absorb(choice, event)
        if text:
            yield sse(shape.chunk(index, text, choice.unsent_logprobs()))
        elif isinstance(event, End):
            yield sse(shape.chunk(index, "", choice.unsent_logprobs(), choice.finish_reason))
    else:
        if include_usage:
            yield sse({**shape.envelope(), "choices": [], "usage": usage(prompt_tokens, choices)})
    yield b"data: [DONE]\n\n"


def token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "replace"))


@dataclass
class CompletionShape:
    id: str
    created: int
    model: str

    def envelope(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def logprobs(self, entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        if not entries:
            return None
        offsets, position = [], offset
        for e in entries:
            offsets.append(position)
            position += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{tok: lp for _, tok, lp in e.top} for e in entries], "text_offset": offsets}

    def response(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        return {**self.envelope(), "choices": [
            {"index": c.index, "text": c.text, "logprobs": self.logprobs(c.logprobs),
             "finish_reason": c.finish_reason} for c in choices], "usage": usage}

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        return None

    def chunk(self, index: int, text: str, entries: list[TokenLogprob], finish: str | None = None) -> dict[str, Any]:
        return {**self.envelope(), "choices": [{"index": index, "text": text, "logprobs": self.logprobs(entries),
                                                "finish_reason": finish}]}


@dataclass
class ChatShape:
    id: str
    created: int
    model: str

    def envelope(self, chunk: bool = True) -> dict[str, Any]:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def logprobs(entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if not entries:
            return None
        return {"content": [{
            "token": e.token, "logprob": e.logprob, "bytes": token_bytes(e.token),
            "top_logprobs": [{"token": tok, "logprob": lp, "bytes": token_bytes(tok)} for _, tok, lp in e.top],
        } for e in entries]}

    def response(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        return {**self.envelope(chunk=False), "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": c.text},
             "logprobs": self.logprobs(c.logprobs), "finish_reason": c.finish_reason} for c in choices],
            "usage": usage}

    def first_chunk(self, index: int) -> dict[str, Any]:
        return {**self.envelope(), "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}

    def chunk(self, index: int, text: str, entries: list[TokenLogprob], finish: str | None = None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {**self.envelope(), "choices": [{"index": index, "delta": delta, "logprobs": self.logprobs(entries),
                                                "finish_reason": finish}]}
