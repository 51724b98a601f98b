"""llama-server's own API: POST /completion, GET /props, GET /slots, POST /apply-template.

OPENAPI_MODELS: the request bodies it documents in the app's OpenAPI schema.

Tools written for llama.cpp's server (its web UI, editor plugins, scripts) call these routes;
with them and the OpenAI routes at the root, a worker stands in for llama-server. A
/completion is one engine job, prepared and submitted like every other API's, its events
framed as llama-server's objects (streamed as `data:` lines with no `[DONE]`, as llama-server
sends them). Errors are in llama-server's shape. /slots lists the jobs in flight and is off
unless the worker runs with --slots, as in llama-server.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from llorch import __version__
from llorch.api.body import BadRequest, read_json, request_body
from llorch.api.errors import (
    LLAMA_SERVER_ERROR_SCHEMA,
    RETRY,
    LlamaServerError,
    error_responses,
    job_error_parts,
    refusal_parts,
)
from llorch.api.generation import CLIENT_CLOSED_REQUEST, unless_disconnected
from llorch.api.jobs import JobStream
from llorch.api.llama_server_schemas import ApplyTemplateRequest, LlamaCompletionRequest
from llorch.api.state import WorkerState
from llorch.api.streaming import sse
from llorch.api.tokenizer_routes import render, tokenize_parts
from llorch.api.violations import one_message
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal, RequestRejected
from llorch.engine.request import (
    End,
    Error,
    Event,
    GenerationRequest,
    PreparedJob,
    Started,
    TokenLogprob,
    TokenText,
)

OPENAPI_MODELS: tuple[type[BaseModel], ...] = (LlamaCompletionRequest, ApplyTemplateRequest)
STOP_TYPES = {"EOS": "eos", "MAX_TOKENS": "limit", "STOP_SEQUENCE": "word", "CANCELLED": "none"}
FIELD_NAMES = {"max_tokens": "n_predict"}  # the engine's names, as this API calls them
SLOTS_OFF = "This server does not support slots endpoint. Start it with `--slots`"

_OBJECT = {"application/json": {"schema": {"type": "object"}}}
_BODY_ERRORS = {400: "Invalid or unsupported parameters", 401: "Missing or wrong API key", 413: "Body too large",
                415: "Compressed body"}


def documented(ok: str, content: dict[str, Any], errors: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": ok, "content": content}, **error_responses(LLAMA_SERVER_ERROR_SCHEMA, errors)}


COMPLETION_RESPONSES = documented(
    "The completion, or its chunks as `data:` lines when stream is true",
    {**_OBJECT, "text/event-stream": {"schema": {"type": "string"}}},
    {**_BODY_ERRORS, 500: "Generation failed", 503: "Loading, draining, busy or out of memory"})
TEMPLATE_RESPONSES = documented("The rendered prompt", _OBJECT, {**_BODY_ERRORS, 503: "Loading"})
PROPS_RESPONSES = documented("The server's properties", _OBJECT, {401: "Missing or wrong API key", 503: "Loading"})
SLOTS_RESPONSES = documented(
    "The jobs in flight", {"application/json": {"schema": {"type": "array"}}},
    {401: "Missing or wrong API key", 503: "Loading, or no free slot"})


def ready(state: WorkerState) -> Engine:
    why = state.unavailable()
    if why or state.engine is None:
        raise LlamaServerError(503, why or "unavailable", RETRY)
    return state.engine


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    try:
        raw = await read_json(request)
    except BadRequest as exc:  # not JSON, too large or compressed: the same message in llama-server's shape
        raise LlamaServerError(exc.status, exc.errors[0]["message"]) from exc
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise LlamaServerError(400, one_message(exc)[1]) from exc


def refusal(exc: EngineRefusal) -> LlamaServerError:
    return LlamaServerError(*refusal_parts(exc, FIELD_NAMES))


def job_error(event: Error) -> LlamaServerError:
    return LlamaServerError(*job_error_parts(event))


# -- /completion ------------------------------------------------------------------------------------

def prepare(engine: Engine, body: LlamaCompletionRequest, seed: int) -> tuple[PreparedJob, str]:
    """The job (through the engine's front door) and its prompt as text; CPU work, for a worker thread."""
    common: dict[str, Any] = {"sampling": body.sampling(seed), "stop": body.stop_sequences,
                              "constraint": body.constraint(), "logprobs": body.logprobs}
    job_id = f"llama-{uuid.uuid4().hex}"
    if isinstance(body.prompt, str):
        request = GenerationRequest(job_id, body.prompt, body.engine_max_tokens, **common)
    else:
        ids = tokenize_parts(engine, body.prompt, True, "prompt")
        request = GenerationRequest(job_id, None, body.engine_max_tokens, prompt_ids=tuple(ids), **common)
    job = engine.prepare(request)
    return job, engine.tokens.decode(job.prompt_ids, skip_special=False)


@dataclass
class Generation:
    """What one /completion job has produced so far, and when (perf_counter seconds)."""

    prompt_tokens: int
    end_ids: frozenset[int]  # end-of-generation tokens: reported among the probabilities, not among the tokens
    content: str = ""
    tokens: list[int] = field(default_factory=list)
    probs: list[TokenLogprob] = field(default_factory=list)
    end: End | None = None
    accepted: float | None = None
    first: float | None = None
    ended: float | None = None

    def absorb(self, event: Event) -> str:
        """Record an event; return the text it adds."""
        now = time.perf_counter()
        if isinstance(event, Started):
            self.accepted = now
        elif isinstance(event, TokenLogprob | TokenText) and self.first is None:
            self.first = now
        if isinstance(event, TokenLogprob):
            self.probs.append(event)
            if event.token_id not in self.end_ids:
                self.tokens.append(event.token_id)
        elif isinstance(event, TokenText):
            self.content += event.t
            return event.t
        elif isinstance(event, End):
            self.end, self.ended = event, now
        return ""

    def timings(self) -> dict[str, float]:
        """Measured here, from the job's events: the prompt from acceptance to the first generated token
        (its wait for a place in the batch included), the rest from there to the end."""
        now = self.ended or time.perf_counter()
        first = self.first or now
        prompt_ms = (first - (self.accepted or first)) * 1000
        predicted_ms = (now - first) * 1000
        predicted = self.end.tokens_out if self.end else len(self.tokens)
        return {"prompt_n": self.prompt_tokens, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / self.prompt_tokens if self.prompt_tokens else 0.0,
                "prompt_per_second": 1000 * self.prompt_tokens / prompt_ms if prompt_ms else 0.0,
                "predicted_n": predicted, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
                "predicted_per_second": 1000 * predicted / predicted_ms if predicted_ms else 0.0}


@dataclass
class Shape:
    """llama-server's /completion objects: a stream's partial chunks, and the final one."""

    body: LlamaCompletionRequest
    engine: Engine
    settings: dict[str, Any]
    prompt: str

    def probabilities(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        def entry(token_id: int, text: str, logprob: float) -> dict[str, Any]:
            return {"id": token_id, "token": text, "logprob": logprob,
                    "bytes": list(self.engine.tokens.token_bytes(token_id, text))}

        return [{**entry(e.token_id, e.token, e.logprob), "top_logprobs": [entry(*top) for top in e.top]}
                for e in entries]

    def partial(self, gen: Generation, text: str, tokens: list[int], probs: list[TokenLogprob]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"index": 0, "content": text, "tokens": tokens, "stop": False,
                                 "id_slot": self.body.id_slot, "tokens_predicted": len(gen.tokens),
                                 "tokens_evaluated": gen.prompt_tokens}
        if self.body.n_probs:
            chunk["completion_probabilities"] = self.probabilities(probs)
        if self.body.timings_per_token:
            chunk["timings"] = gen.timings()
        return chunk

    def final(self, gen: Generation, streamed: bool) -> dict[str, Any]:
        """The last object; a stream has sent the text, tokens and probabilities already."""
        end = gen.end
        assert end is not None
        answer: dict[str, Any] = {
            "index": 0, "content": "" if streamed else gen.content,
            "tokens": gen.tokens if self.body.return_tokens and not streamed else [],
            "id_slot": self.body.id_slot, "stop": True, "model": self.engine.model_id,
            "tokens_predicted": end.tokens_out, "tokens_evaluated": gen.prompt_tokens,
            "generation_settings": self.settings, "prompt": self.prompt, "has_new_line": "\n" in gen.content,
            "truncated": False, "stop_type": STOP_TYPES[end.stop_reason.value],
            "stopping_word": end.stop_sequence_matched or "", "timings": gen.timings()}
        if self.body.n_probs and not streamed:
            answer["completion_probabilities"] = self.probabilities(gen.probs)
        if self.body.response_fields:
            return picked(answer, self.body.response_fields)
        return answer


def picked(answer: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: only these fields, a nested one ("a/b") under its whole path."""
    chosen: dict[str, Any] = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            chosen[path] = value
    return chosen


async def complete(http: Request, engine: Engine, body: LlamaCompletionRequest) -> Response:
    seed = body.seed_to_use()
    try:
        job, prompt = await run_in_threadpool(prepare, engine, body, seed)
        stream = JobStream(engine, job)
    except EngineRefusal as exc:
        raise refusal(exc) from exc
    gen = Generation(len(job.prompt_ids), frozenset(engine.tokens.eos_token_ids))
    shape = Shape(body, engine, body.settings(seed, engine.ctx_size, engine.model_id), prompt)
    if body.stream:
        return StreamingResponse(chunks(stream, gen, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect() -> None:
        async for event in stream.events():
            if isinstance(event, Error):
                raise job_error(event)
            gen.absorb(event)

    if not await unless_disconnected(http, asyncio.ensure_future(collect())):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the job is cancelled
    return JSONResponse(shape.final(gen, streamed=False))


async def chunks(stream: JobStream, gen: Generation, shape: Shape) -> AsyncIterator[bytes]:
    """A chunk per piece of text with the tokens and probabilities that came since the last one, then the
    final object. A client that goes away cancels the job (JobStream)."""
    sent_tokens = sent_probs = 0
    async for event in stream.events():
        if isinstance(event, Error):
            yield sse(job_error(event).body())
            return
        text = gen.absorb(event)
        unsent = len(gen.tokens) > sent_tokens or len(gen.probs) > sent_probs
        if isinstance(event, TokenText) or (isinstance(event, End) and unsent):
            yield sse(shape.partial(gen, text, gen.tokens[sent_tokens:], gen.probs[sent_probs:]))
            sent_tokens, sent_probs = len(gen.tokens), len(gen.probs)
        if isinstance(event, End):
            yield sse(shape.final(gen, streamed=True))


# -- /props, /slots, /apply-template ----------------------------------------------------------------

def props(engine: Engine) -> dict[str, Any]:
    tokenizer = engine.tokens
    template = engine.chat_template
    defaults = LlamaCompletionRequest(prompt="")
    spelled = {name: tokenizer.token_text(token) if token is not None else "" for name, token in (
        ("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_id))}
    return {"default_generation_settings": {
                "id": 0, "id_task": -1, "n_ctx": engine.ctx_size, "speculative": False, "is_processing": False,
                "params": defaults.settings(defaults.seed, engine.ctx_size, engine.model_id), "prompt": "",
                "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1, "n_decoded": 0}},
            "total_slots": engine.config.max_running,
            "model_path": str(engine.model_path) if engine.model_path else engine.model_name,
            "chat_template": template.source if template else "", **spelled,
            "modalities": {"vision": False, "audio": False}, "build_info": f"llorch {__version__}",
            "is_sleeping": False}


def slots(engine: Engine) -> list[dict[str, Any]]:
    """Each job in flight as a slot: `id` is its place in this list (there are no fixed slots), `id_task` its job."""
    listed = []
    for index, view in enumerate(engine.job_views()):
        slot: dict[str, Any] = {"id": index, "id_task": view.job_id, "n_ctx": engine.ctx_size, "speculative": False,
                                "is_processing": view.state == "running", "n_prompt_tokens": view.prompt_tokens,
                                "next_token": [{"has_next_token": True, "n_decoded": view.generated_tokens}]}
        if view.prompt is not None:
            slot["prompt"] = view.prompt
        listed.append(slot)
    return listed


def create_llama_server_router(state: WorkerState, slots_enabled: bool = False) -> APIRouter:
    router = APIRouter()

    @router.post("/completion", response_model=None, openapi_extra=request_body(LlamaCompletionRequest),
                 responses=COMPLETION_RESPONSES)
    async def completion(request: Request) -> Response:
        try:
            body = await parse_body(request, LlamaCompletionRequest)
            return await complete(request, ready(state), body)
        except LlamaServerError as exc:
            return exc.response()

    @router.get("/props", response_model=None, responses=PROPS_RESPONSES)
    async def props_route() -> dict[str, Any] | JSONResponse:
        try:
            return props(ready(state))
        except LlamaServerError as exc:
            return exc.response()

    # Documented only when served: off, it answers 501, as a route llama-server does not have (for clients).
    @router.get("/slots", response_model=None, responses=SLOTS_RESPONSES, include_in_schema=slots_enabled)
    async def slots_route(request: Request) -> list[dict[str, Any]] | JSONResponse:
        try:
            if not slots_enabled:
                raise LlamaServerError(501, SLOTS_OFF)
            engine = ready(state)
            listed = slots(engine)
            # ?fail_on_no_slot=1: a 503 when every place in the batch is taken (any other value: off).
            full = sum(slot["is_processing"] for slot in listed) >= engine.config.max_running
            if full and request.query_params.get("fail_on_no_slot", "").lower() in ("1", "true"):
                raise LlamaServerError(503, "no slot available")
            return listed
        except LlamaServerError as exc:
            return exc.response()

    @router.post("/apply-template", response_model=None, openapi_extra=request_body(ApplyTemplateRequest),
                 responses=TEMPLATE_RESPONSES)
    async def apply_template(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = await parse_body(request, ApplyTemplateRequest)
            engine = ready(state)
            try:
                text = await run_in_threadpool(render, engine, body.messages, body.tools, body.chat_options())
            except RequestRejected as exc:
                raise refusal(exc) from exc
            return {"prompt": text}
        except LlamaServerError as exc:
            return exc.response()

    return router
