"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

OPENAPI_MODELS: the request bodies it documents in the app's OpenAPI schema.

Each prompt of a request goes through the engine's front door once (chat messages are
rendered there); each of its n choices is one engine job, submitted through the same
JobStream as the worker API: one generation path, two wire formats. Choice i*n + j is
prompt i's j-th. With `echo`, a completion's text and log-probabilities start with its
prompt's, scored by the engine as it reads the prompt.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from llorch.api.body import BadRequest, read_json, request_body
from llorch.api.errors import (
    OPENAI_ERROR_SCHEMA,
    OpenAIError,
    error_responses,
    openai_job_error,
    openai_refusal,
)
from llorch.api.generation import (
    CLIENT_CLOSED_REQUEST,
    merged,
    prepare_all,
    tool_constraint,
    unless_disconnected,
)
from llorch.api.jobs import JobStream
from llorch.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from llorch.api.state import WorkerState
from llorch.api.streaming import sse
from llorch.api.tool_calls import ToolFormat
from llorch.api.turn import Piece, Turn
from llorch.api.violations import one_message
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import (
    End,
    Error,
    Event,
    GenerationRequest,
    PreparedJob,
    PromptLogprobs,
    TokenLogprob,
    TokenText,
)

log = logging.getLogger("llorch.api")
FINISH_REASONS = {"MAX_TOKENS": "length", "EOS": "stop", "STOP_SEQUENCE": "stop"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
        if self.tool_calls and self.end.stop_reason.value != "MAX_TOKENS":
            return "tool_calls"
        return FINISH_REASONS.get(self.end.stop_reason.value)


GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "A completion, or its chunks when stream=true",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
                          "data": {"type": "string"}}}}}},
    **error_responses(OPENAI_ERROR_SCHEMA, {
        400: "Invalid or unsupported parameters", 401: "Missing or wrong API key", 404: "Unknown model",
        413: "Body too large", 500: "Generation failed", 503: "Loading, draining or out of memory"}),
}


OPENAPI_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest)


def model_card(engine: Engine) -> dict[str, Any]:
    """The served model as OpenAI's model object, with llorch's facts about it."""
    return {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "llorch",
            "context_length": engine.ctx_size, "max_model_len": engine.ctx_size,
            "chat_template": engine.chat_template.name if engine.chat_template else None}


def ready(state: WorkerState) -> Engine:
    """The engine, or a 503 while the worker loads or drains."""
    why = state.unavailable()
    if why or state.engine is None:
        raise OpenAIError(503, why or "unavailable", kind="server_error", code="unavailable")
    return state.engine


def validation_error(exc: ValidationError) -> OpenAIError:
    """Every violation in one message, `param` naming the first."""
    param, message = one_message(exc)
    return OpenAIError(400, message, param=param)


async def parse_body(request: Request, model: type[BaseModel], state: WorkerState) -> Any:
    """A request body validated against `model`, or the OpenAIError naming what is wrong with it.

    A body that names a model must name the one this worker serves (404 otherwise).
    """
    try:
        raw = await read_json(request)
    except BadRequest as exc:  # not JSON, or too large: the same message in OpenAI's shape
        raise OpenAIError(exc.status, exc.errors[0]["message"]) from exc
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    engine = ready(state)  # 503 while loading or draining, before anything else
    named_model = getattr(body, "model", None)
    if named_model is not None and named_model != engine.model_id:
        raise OpenAIError(404, f"The model `{named_model}` does not exist; this worker serves "
                          f"`{engine.model_id}`.", param="model", code="model_not_found")
    return body


def create_openai_router(state: WorkerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models", response_model=None, responses=error_responses(OPENAI_ERROR_SCHEMA, {503: "Loading"}))
    async def models() -> dict[str, Any] | JSONResponse:
        try:
            engine = ready(state)
        except OpenAIError as exc:
            return exc.response()
        return {"object": "list", "data": [model_card(engine)]}

    @router.get("/models/{model_id:path}", response_model=None, responses=error_responses(
        OPENAI_ERROR_SCHEMA, {404: "Unknown model", 503: "Loading"}))
    async def model(model_id: str) -> dict[str, Any] | JSONResponse:
        try:
            engine = ready(state)
            if model_id != engine.model_id:
                raise OpenAIError(404, f"The model `{model_id[:200]}` does not exist; this worker serves "
                                  f"`{engine.model_id}`.", param="model", code="model_not_found")
        except OpenAIError as exc:
            return exc.response()
        return model_card(engine)

    @router.post("/completions", response_model=None, openapi_extra=request_body(CompletionRequest),
                 responses=GENERATION_RESPONSES)
    async def completions(request: Request) -> JSONResponse | StreamingResponse | Response:
        try:
            body = await parse_body(request, CompletionRequest, state)
            engine = ready(state)
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
            if len(body.prompts) * body.n > engine.config.max_queue:
                raise OpenAIError(400, f"{len(body.prompts)} prompts with n={body.n} are "
                                  f"{len(body.prompts) * body.n} jobs; this worker queues at most "
                                  f"{engine.config.max_queue} (--max-queue)", param="prompt")
            scored = body.logprobs if body.echo else None
            # Each choice gets its own sampling (its own seed); the front door checks the first's logit_bias.
            jobs = [GenerationRequest("", prompt if isinstance(prompt, str) else None, max_tokens, body.sampling(0),
                                      stop=body.stop_sequences, logprobs=body.logprobs, constraint=body.constraint(),
                                      prompt_ids=None if isinstance(prompt, str) else tuple(prompt),
                                      prompt_logprobs=scored)
                    for prompt in body.prompts]
            return await generate(request, engine, body, jobs, chat=False, echo=body.echo)
        except OpenAIError as exc:
            return exc.response()

    @router.post("/chat/completions", response_model=None, openapi_extra=request_body(ChatCompletionRequest),
                 responses=GENERATION_RESPONSES)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse | Response:
        try:
            body = await parse_body(request, ChatCompletionRequest, state)
            engine = ready(state)
            top = (body.top_logprobs or 0) if body.logprobs else None
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            fmt, constraint = None, body.constraint()
            if tools and body.tool_mode is not None:
                fmt, constraint = tool_constraint(engine, tools, body.tool_mode, body.parallel_tool_calls)
            job = GenerationRequest("", None, body.max_completion_tokens or body.max_tokens, body.sampling(0),
                                    stop=body.stop_sequences,
                                    logprobs=top, messages=tuple(m.for_template() for m in body.messages),
                                    tools=tuple(tools) if tools else None, constraint=constraint,
                                    chat_options=body.chat_options())
            calls = fmt if body.tool_mode not in (None, "none") else None
            return await generate(request, engine, body, [job], chat=True, tool_format=calls)
        except OpenAIError as exc:
            return exc.response()

    return router


def echo_start(engine: Engine, job: PreparedJob) -> tuple[str, list[LogprobEntry]]:
    """What an echoed choice starts with: the prompt's text, and its unscored first token when it is scored.

    A BOS the worker put in front of given token ids is not echoed: the echo holds exactly the
    client's tokens, each of them scored (a client slicing by position finds its own tokens).
    """
    tokenizer = engine.front.tokenizer
    given = job.prompt_ids[1:] if job.added_bos else job.prompt_ids
    text = job.request.prompt if job.request.prompt is not None else tokenizer.decode(given)
    if job.request.prompt_logprobs is None or job.added_bos:
        return text, []
    return text, [UnscoredToken(job.prompt_ids[0], tokenizer.token_text(job.prompt_ids[0]))]


async def generate(http: Request, engine: Engine, body: Any, requests: list[GenerationRequest], chat: bool,
                   tool_format: ToolFormat | None = None, echo: bool = False
                   ) -> JSONResponse | StreamingResponse | Response:
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    streams: list[JobStream] = []
    try:
        prepared = await run_in_threadpool(prepare_all, engine, requests)
        for job in prepared:
            for i in range(body.n):
                index = len(streams)
                streams.append(JobStream(engine, job.for_choice(f"{request_id}-{index}", body.sampling(i))))
    except EngineRefusal as exc:
        for submitted in streams:  # all choices or none
            engine.cancel(submitted.job_id)
        raise openai_refusal(exc) from exc
    prompt_tokens = sum(len(job.prompt_ids) for job in prepared)
    created = int(time.time())
    special = engine.front.tokenizer.special_ids
    shape = ChatShape(request_id, created, engine.model_id, getattr(body, "legacy_functions", False)) if chat \
        else CompletionShape(request_id, created, engine.model_id, special)
    choices: list[Choice] = []
    for job in prepared:  # choice i * n + j is prompt i's j-th
        text, first = echo_start(engine, job) if echo else (None, [])
        for _ in range(body.n):
            choices.append(Choice(len(choices), logprobs=list(first), echo=text,
                                  turn=Turn.for_chat(engine, job, tool_format) if chat else None))
    if body.stream:
        return StreamingResponse(stream_chunks(engine, streams, choices, shape, body.include_usage, prompt_tokens),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    if not await unless_disconnected(http, asyncio.ensure_future(collect(engine, streams, choices))):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the jobs are cancelled
    for choice in choices:
        choice.text = choice.take_echo() + choice.text
    return JSONResponse(shape.response(choices, usage(prompt_tokens, choices)))


async def collect(engine: Engine, streams: list[JobStream], choices: list[Choice]) -> None:
    """Every event of every choice into its Choice; a job's error ends the request."""
    async for index, event in merged(streams):
        if isinstance(event, Error):
            raise openai_job_error(event)
        text = absorb(choices[index], event, keep_text=choices[index].turn is None)
        if choices[index].turn is not None and (text or isinstance(event, End)):
            piece = split_turn(engine, streams[index], choices[index], text, isinstance(event, End))
            choices[index].text += piece.content


def split_turn(engine: Engine, stream: JobStream, choice: Choice, text: str, end: bool) -> Piece:
    """New text of a chat choice split into reasoning, content and calls, recorded in the choice.

    A turn that has ended early (a repeated tool call) cancels its job: the rest would be discarded.
    """
    assert choice.turn is not None
    piece = choice.turn.take(text, end)
    choice.reasoning += piece.reasoning
    choice.tool_calls.extend(piece.calls)
    if choice.turn.finished and not end:
        engine.cancel(stream.job_id)
    return piece


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


async def stream_chunks(engine: Engine, streams: list[JobStream], choices: list[Choice], shape: Any,
                        include_usage: bool, prompt_tokens: int) -> AsyncIterator[bytes]:
    for choice in choices:
        first = shape.first_chunk(choice.index)
        if first:
            yield sse(first)
    async for index, event in merged(streams):
        choice = choices[index]
        if isinstance(event, Error):
            yield sse(openai_job_error(event).body())
            break
        if choice.echo is not None and isinstance(event, TokenText | TokenLogprob | End):
            # The prompt is read: its text and log-probabilities go first, in a chunk of their own.
            yield sse(shape.chunk(choice, choice.take_echo(), choice.unsent_logprobs()))
        text = absorb(choice, event, keep_text=choice.turn is None)
        if isinstance(event, PromptLogprobs):
            continue
        calls: list[dict[str, Any]] = []
        reasoning = ""
        if choice.turn is not None and (text or isinstance(event, End)):
            first = len(choice.tool_calls)
            piece = split_turn(engine, streams[index], choice, text, isinstance(event, End))
            text, calls, reasoning = piece.content, piece.calls, piece.reasoning
        if reasoning:
            yield sse(shape.reasoning_chunk(index, reasoning))
        if text or len(choice.logprobs) > choice.streamed_logprobs:
            yield sse(shape.chunk(choice, text, choice.unsent_logprobs()))
        for offset, call in enumerate(calls):  # each call: its id and name, then its arguments
            for delta in tool_call_deltas(first + offset, call):
                yield sse(shape.tool_chunk(index, delta))
        if isinstance(event, End):
            yield sse(shape.chunk(choice, "", choice.unsent_logprobs(), shape.finish(choice)))
    else:
        if include_usage:
            yield sse({**shape.envelope(), "choices": [], "usage": usage(prompt_tokens, choices)})
    yield b"data: [DONE]\n\n"


def tool_call_deltas(index: int, call: dict[str, Any]) -> list[dict[str, Any]]:
    """A call as stream deltas, the way OpenAI sends them: id, type and name first, then the arguments."""
    function = call["function"]
    return [{"index": index, "id": call["id"], "type": "function", "function": {"name": function["name"],
                                                                                  "arguments": ""}},
            {"index": index, "function": {"arguments": function["arguments"]}}]


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
