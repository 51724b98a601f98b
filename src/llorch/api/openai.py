"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Each of the n choices of a request is one engine job, submitted through the same
JobStream as the worker API: one generation path, two wire formats.
"""

from __future__ import annotations

import asyncio
import json
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
from llorch.api.jobs import RETRY_AFTER_S, JobStream
from llorch.api.openai_schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from llorch.engine.engine import DuplicateJob, Engine, QueueFull, RequestRejected
from llorch.engine.request import End, Error, ErrorCode, Event, GenerationRequest, TokenLogprob, TokenText
from llorch.weights.chat_template import ChatTemplate, ChatTemplateError

FINISH_REASONS = {"MAX_TOKENS": "length", "EOS": "stop", "STOP_SEQUENCE": "stop"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def openai_error_from_event(event: Error) -> OpenAIError:
    if event.code is ErrorCode.VRAM_OOM:
        return OpenAIError(503, event.message, code="out_of_memory", kind="server_error")
    return OpenAIError(500, event.message, code=event.code.value.lower(), kind="server_error")


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


class OpenAIContext:
    """The worker's state as the OpenAI routes see it (the engine arrives after loading)."""

    def __init__(self, state: Any) -> None:
        self._state = state

    @property
    def model_id(self) -> str:
        return self._state.model_id

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._state.chat_template

    def ready(self) -> Engine:
        """The engine, or a 503 while the worker loads or drains."""
        why = self._state.unavailable()
        if why or self._state.engine is None:
            raise OpenAIError(503, why or "unavailable", kind="server_error", code="unavailable")
        return self._state.engine


_ERROR_BODY = {"application/json": {"schema": {"type": "object", "required": ["error"], "properties": {
    "error": {"type": "object", "required": ["message", "type"]}}}}}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "A completion, or its chunks when stream=true",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
                          "data": {"type": "string"}}}}}},
    **{code: {"description": text, "content": _ERROR_BODY} for code, text in (
        (400, "Invalid or unsupported parameters"), (401, "Missing or wrong API key"), (404, "Unknown model"),
        (413, "Body too large"), (500, "Generation failed"), (503, "Loading, draining or out of memory"))},
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


def create_openai_router(ctx: OpenAIContext) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models", response_model=None, responses={503: {"description": "Loading",
                                                                   "content": _ERROR_BODY}})
    async def models() -> dict[str, Any] | JSONResponse:
        try:
            ctx_size = ctx.ready().ctx_size
        except OpenAIError as exc:
            return exc.response()
        return {"object": "list", "data": [{
            "id": ctx.model_id, "object": "model", "created": 0, "owned_by": "llorch",
            "context_length": ctx_size, "max_model_len": ctx_size,
        }]}

    @router.post("/completions", response_model=None, openapi_extra=request_body(CompletionRequest),
                 responses=GENERATION_RESPONSES)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        try:
            body = await parse(request, CompletionRequest)
            return await generate(ctx, body, body.prompt_text, True, body.logprobs, chat=False)
        except OpenAIError as exc:
            return exc.response()

    @router.post("/chat/completions", response_model=None, openapi_extra=request_body(ChatCompletionRequest),
                 responses=GENERATION_RESPONSES)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        try:
            body = await parse(request, ChatCompletionRequest)
            if ctx.chat_template is None:
                raise OpenAIError(400, "this model has no chat template; use /v1/completions or start the "
                                  "worker with --chat-template-file", param="messages",
                                  code="chat_template_missing")
            try:
                prompt = ctx.chat_template.render([m.for_template() for m in body.messages])
            except ChatTemplateError as exc:
                raise OpenAIError(400, str(exc), param="messages") from exc
            top = (body.top_logprobs or 0) if body.logprobs else None
            # The template spells out BOS and the turn markers itself.
            return await generate(ctx, body, prompt, False, top, chat=True)
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
        ctx.ready()  # 503 while loading or draining, before anything else
        if body.model != ctx.model_id:
            raise OpenAIError(404, f"The model `{body.model}` does not exist; this worker serves "
                              f"`{ctx.model_id}`.", param="model", code="model_not_found")
        return body

    return router


async def generate(ctx: OpenAIContext, body: Any, prompt: str, add_special: bool, logprobs: int | None,
                   chat: bool) -> JSONResponse | StreamingResponse:
    engine = ctx.ready()
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    prompt_ids = await run_in_threadpool(engine.tokenizer.encode, prompt, add_special)
    if max_tokens is None:  # chat: up to the context (or KV pool); completions: OpenAI's default of 16
        max_tokens = max(1, engine.max_sequence_tokens - len(prompt_ids)) if chat else 16
    try:
        engine.check_fits(len(prompt_ids), max_tokens)
    except RequestRejected as exc:
        code = "context_length_exceeded" if exc.field == "max_tokens" else "prompt_too_long"
        raise OpenAIError(400, exc.message, param=exc.field, code=code) from exc
    jobs = [GenerationRequest(f"{request_id}-{i}", prompt, max_tokens, body.sampling(i), body.stop_sequences,
                              logprobs, add_special) for i in range(body.n)]
    streams: list[JobStream] = []
    try:
        for job in jobs:
            streams.append(JobStream(engine, job, prompt_ids))
    except DuplicateJob as exc:  # request ids are random: this cannot happen twice
        raise OpenAIError(500, "job id collision", kind="server_error") from exc
    except QueueFull as exc:
        for submitted in streams:  # all n choices or none
            engine.cancel(submitted.request.job_id)
        raise OpenAIError(503, f"The worker is busy: {exc}. Retry shortly.", kind="server_error",
                          code="server_busy", headers={"Retry-After": RETRY_AFTER_S}) from exc
    created = int(time.time())
    shape = ChatShape(request_id, created, ctx.model_id) if chat else CompletionShape(request_id, created, ctx.model_id)
    if body.stream:
        return StreamingResponse(stream_chunks(streams, shape, body.include_usage, len(prompt_ids)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    choices = [Choice(i) for i in range(len(streams))]
    async for index, event in merged(streams):
        if isinstance(event, Error):
            raise openai_error_from_event(event)
        absorb(choices[index], event)
    return JSONResponse(shape.response(choices, usage(len(prompt_ids), choices)))


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
            yield sse(openai_error_from_event(event).body())
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


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


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
