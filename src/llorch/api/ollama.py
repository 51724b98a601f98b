"""Ollama's API: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version.

OPENAPI_MODELS: the request bodies it documents in the app's OpenAPI schema.

Desktop apps and scripts that speak only Ollama's API use a worker through these routes.
A chat or a prompt becomes one engine job, prepared and submitted like every other API's;
its events are framed as Ollama's JSON lines (streaming is Ollama's default) or as one
object. The only model is the served one: it is listed as `<model id>:latest`, and any
other name is a 404, as Ollama answers for a model it does not have.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from llorch.api.body import BadRequest, read_json, request_body
from llorch.api.errors import RETRY, error_responses, job_error_parts, refusal_parts
from llorch.api.generation import CLIENT_CLOSED_REQUEST, tool_constraint, unless_disconnected
from llorch.api.jobs import JobStream
from llorch.api.ollama_schemas import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    ChatRequest,
    GenerateRequest,
    GenerationBody,
    ShowRequest,
)
from llorch.api.reasoning import reasoning_markers
from llorch.api.state import WorkerState
from llorch.api.streaming import NDJSON
from llorch.api.tool_calls import ToolFormat, new_call_id
from llorch.api.turn import Piece, Turn
from llorch.api.violations import one_message
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import End, Error, Event, GenerationRequest, Started, TokenLogprob, TokenText
from llorch.weights.model_facts import ModelFacts

OPENAPI_MODELS: tuple[type[BaseModel], ...] = (ChatRequest, GenerateRequest, ShowRequest)

# The Ollama release whose API these routes follow (thinking, streamed tool calls): apps gate features on it.
OLLAMA_API_VERSION = "0.9.0"
DONE_REASONS = {"MAX_TOKENS": "length", "EOS": "stop", "STOP_SEQUENCE": "stop"}
LATEST = ":latest"
NEVER_EXPIRES = "9999-12-31T23:59:59Z"  # the model stays loaded for the worker's life
# The engine's field names, as this API calls them.
FIELD_NAMES = {"max_tokens": "options.num_predict", "tools": "tools", "format": "format"}

_ERROR_SCHEMA = {"application/json": {"schema": {"type": "object", "required": ["error"], "properties": {
    "error": {"type": "string"}}}}}
_OBJECT = {"application/json": {"schema": {"type": "object"}}}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The answer, or its JSON lines when stream is true (the default)",
          "content": {**_OBJECT, NDJSON: {"schema": {"type": "string"}}}},
    **error_responses(_ERROR_SCHEMA, {
        400: "Invalid or unsupported parameters", 401: "Missing or wrong API key", 404: "Not the served model",
        413: "Body too large", 500: "Generation failed", 503: "Loading, draining, busy or out of memory"}),
}
SHOW_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The model's details", "content": _OBJECT},
    **error_responses(_ERROR_SCHEMA, {400: "Invalid request", 401: "Missing or wrong API key",
                                      404: "Not the served model", 413: "Body too large", 503: "Loading"}),
}
LISTING_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The served model", "content": _OBJECT},
    **error_responses(_ERROR_SCHEMA, {401: "Missing or wrong API key", 503: "Loading"}),
}


class OllamaError(Exception):
    """An error answer in Ollama's shape, `{"error": message}`."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.message}, self.status, headers=self.headers)


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    try:
        raw = await read_json(request)
    except BadRequest as exc:  # not JSON, or too large: the same message in Ollama's shape
        raise OllamaError(exc.status, exc.errors[0]["message"]) from exc
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise OllamaError(400, one_message(exc)[1]) from exc


def ready(state: WorkerState) -> Engine:
    why = state.unavailable()
    if why or state.engine is None:
        raise OllamaError(503, why or "unavailable", RETRY)
    return state.engine


def listed_name(engine: Engine) -> str:
    return engine.model_id + LATEST


def check_model(engine: Engine, name: str) -> None:
    """The served model answers to its id, with or without ":latest" (any case); other names are unknown."""
    wanted = name.lower().removesuffix(LATEST)
    if wanted != engine.model_id.lower():
        raise OllamaError(404, f"model '{name}' not found")


def refusal(exc: EngineRefusal) -> OllamaError:
    return OllamaError(*refusal_parts(exc, FIELD_NAMES))


def job_error(event: Error) -> OllamaError:
    return OllamaError(*job_error_parts(event))


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


# -- one answer: thinking, content and tool calls --------------------------------------------------

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

    def stats(self, prompt_tokens: int, end: End) -> dict[str, Any]:
        """Ollama's counts and durations: the prompt is read from acceptance to the first token."""
        finish = self.end or time.perf_counter_ns()
        accepted = self.accepted or self.start
        first = self.first or finish
        return {"done_reason": DONE_REASONS.get(end.stop_reason.value, "stop"), "total_duration": finish - self.start,
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
        return StreamingResponse(stream_lines(stream, reply, clock, shape, prompt_tokens), media_type=NDJSON,
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
    return JSONResponse({**shape.body(reply.whole, collected, done=True), **clock.stats(prompt_tokens, ended[0])})


async def stream_lines(stream: JobStream, reply: Reply, clock: Clock, shape: Shape,
                       prompt_tokens: int) -> AsyncIterator[bytes]:
    pending: list[TokenLogprob] = []  # log-probabilities wait for the text they belong to
    async for event in stream.events():
        clock.mark(event)
        if isinstance(event, Error):
            yield ndjson({"error": job_error(event).message})
            return
        if isinstance(event, TokenLogprob):
            pending.append(event)
        elif isinstance(event, TokenText):
            piece = reply.feed(event.t)
            if reply.turn.finished:  # a repeated call ended the turn
                stream.engine.cancel(stream.job_id)
            if piece:
                yield ndjson(shape.body(piece, pending, done=False))
                pending = []
        elif isinstance(event, End):
            piece = reply.finish()
            if piece:
                yield ndjson(shape.body(piece, pending, done=False))
                pending = []
            yield ndjson({**shape.body(Piece(), pending, done=True), **clock.stats(prompt_tokens, event)})


def check_thinking(engine: Engine, body: GenerationBody) -> None:
    """Asking a model that does not think to think is a 400, as in Ollama."""
    if body.thinks and reasoning_markers(engine.chat_template.source if engine.chat_template else None) is None:
        raise OllamaError(400, f"model '{body.model}' does not support thinking")


def chat_job(engine: Engine, body: ChatRequest) -> tuple[GenerationRequest, ToolFormat | None]:
    call_ids = [new_call_id() for m in body.messages for c in m.tool_calls or [] if c.id is None]
    messages = tuple(m.for_template(call_ids) for m in body.messages)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    fmt, constraint = None, body.constraint()
    if tools:  # Ollama has no tool_choice: the model may answer in text or call
        fmt, constraint = tool_constraint(engine, tools, "auto", True)
    options = body.options
    return GenerationRequest("", None, options.max_tokens, options.sampling(), stop=options.stop_sequences,
                             logprobs=body.logprob_count, messages=messages, tools=tuple(tools) if tools else None,
                             constraint=constraint), fmt


def generate_job(body: GenerateRequest) -> GenerationRequest:
    """raw: the prompt as it is; otherwise one user turn (after the system prompt) through the chat template."""
    options = body.options
    common = {"sampling": options.sampling(), "stop": options.stop_sequences, "logprobs": body.logprob_count,
              "constraint": body.constraint()}
    if body.raw:
        return GenerationRequest("", body.prompt, options.max_tokens, **common)
    system = [{"role": "system", "content": body.system}] if body.system is not None else []
    messages = (*system, {"role": "user", "content": body.prompt})
    return GenerationRequest("", None, options.max_tokens, messages=messages, **common)


# -- what the model is ------------------------------------------------------------------------------

def human_count(count: int) -> str:
    """A parameter count as Ollama writes it: 268.10M, 1.1B, 8B."""
    if count >= 10**9:
        value = count / 10**9
        return f"{value:.0f}B" if value == int(value) else f"{value:.1f}B"
    if count >= 10**6:
        return f"{count / 10**6:.2f}M"
    if count >= 10**3:
        return f"{count / 10**3:.0f}K"
    return str(count)


def details(engine: Engine, facts: ModelFacts) -> dict[str, Any]:
    architecture = engine.model_config.architecture
    return {"parent_model": "", "format": facts.format, "family": architecture, "families": [architecture],
            "parameter_size": human_count(facts.parameter_count),
            "quantization_level": facts.quantization_level}


def model_info(engine: Engine, facts: ModelFacts) -> dict[str, Any]:
    """The model's shapes under GGUF's key names, as Ollama reports them (apps read the context length here)."""
    config = engine.model_config
    arch = config.architecture
    return {"general.architecture": arch, "general.basename": engine.model_name,
            "general.parameter_count": facts.parameter_count,
            f"{arch}.context_length": config.context_length, f"{arch}.embedding_length": config.hidden_size,
            f"{arch}.block_count": config.num_layers, f"{arch}.feed_forward_length": config.intermediate_size,
            f"{arch}.attention.head_count": config.num_heads, f"{arch}.attention.head_count_kv": config.num_kv_heads,
            f"{arch}.attention.key_length": config.head_dim, f"{arch}.attention.value_length": config.head_dim,
            f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
            f"{arch}.rope.freq_base": config.rope_theta,
            "general.file_type": facts.quantization_level}


def capabilities(engine: Engine) -> list[str]:
    found = ["completion", "tools"]  # every template can call tools (the default convention when it knows none)
    if reasoning_markers(engine.chat_template.source if engine.chat_template else None):
        found.append("thinking")
    return found


# -- the routes -------------------------------------------------------------------------------------

def create_ollama_router(state: WorkerState) -> APIRouter:
    router = APIRouter(prefix="/api")
    known: dict[str, ModelFacts] = {}  # per model id: read once, off the event loop

    async def facts(engine: Engine) -> ModelFacts:
        if engine.model_id not in known:
            known[engine.model_id] = await run_in_threadpool(engine.model_facts)
        return known[engine.model_id]

    async def entry(engine: Engine) -> dict[str, Any]:
        found = await facts(engine)
        name = listed_name(engine)
        return {"name": name, "model": name, "modified_at": found.modified_at, "size": found.size,
                "digest": found.digest, "details": details(engine, found)}

    @router.get("/version", response_model=None, responses=LISTING_RESPONSES)
    async def version() -> dict[str, Any]:
        return {"version": OLLAMA_API_VERSION}

    @router.get("/tags", response_model=None, responses=LISTING_RESPONSES)
    async def tags() -> dict[str, Any] | JSONResponse:
        try:
            engine = ready(state)
        except OllamaError as exc:
            return exc.response()
        return {"models": [await entry(engine)]}

    @router.get("/ps", response_model=None, responses=LISTING_RESPONSES)
    async def ps() -> dict[str, Any] | JSONResponse:
        try:
            engine = ready(state)
        except OllamaError as exc:
            return exc.response()
        resident = engine.resident_bytes
        on_gpu = engine.device.type == "cuda"
        return {"models": [{**await entry(engine), "size": resident, "size_vram": resident if on_gpu else 0,
                            "expires_at": NEVER_EXPIRES, "context_length": engine.ctx_size}]}

    @router.post("/show", response_model=None, openapi_extra=request_body(ShowRequest), responses=SHOW_RESPONSES)
    async def show(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = await parse_body(request, ShowRequest)
            engine = ready(state)
            check_model(engine, body.model_name)
        except OllamaError as exc:
            return exc.response()
        found = await facts(engine)
        template = engine.chat_template.source if engine.chat_template else ""
        parameters = (f"temperature {DEFAULT_TEMPERATURE}\ntop_k {DEFAULT_TOP_K}\ntop_p {DEFAULT_TOP_P}\n"
                      f"num_ctx {engine.ctx_size}")
        return {"modelfile": f"# served by llorch\nFROM {engine.model_id}\nTEMPLATE \"\"\"{template}\"\"\"\n"
                             + "".join(f"PARAMETER {line}\n" for line in parameters.splitlines()),
                "parameters": parameters, "template": template, "details": details(engine, found),
                "model_info": model_info(engine, found), "capabilities": capabilities(engine),
                "modified_at": found.modified_at}

    @router.post("/chat", response_model=None, openapi_extra=request_body(ChatRequest),
                 responses=GENERATION_RESPONSES)
    async def chat(request: Request) -> Response:
        try:
            body = await parse_body(request, ChatRequest)
            engine = ready(state)
            check_model(engine, body.model)
            check_thinking(engine, body)
            shape = Shape("chat", body.model, bool(body.top_logprobs))
            if not body.messages:
                return JSONResponse(shape.loaded())
            job, fmt = chat_job(engine, body)
            return await answer(request, engine, job, body, shape, fmt, templated=True)
        except OllamaError as exc:
            return exc.response()

    @router.post("/generate", response_model=None, openapi_extra=request_body(GenerateRequest),
                 responses=GENERATION_RESPONSES)
    async def generate(request: Request) -> Response:
        try:
            body = await parse_body(request, GenerateRequest)
            engine = ready(state)
            check_model(engine, body.model)
            check_thinking(engine, body)
            shape = Shape("generate", body.model, bool(body.top_logprobs))
            if not body.prompt:
                return JSONResponse(shape.loaded())
            return await answer(request, engine, generate_job(body), body, shape, None, templated=not body.raw)
        except OllamaError as exc:
            return exc.response()

    return router
