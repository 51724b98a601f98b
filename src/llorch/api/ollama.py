"""Ollama's API: /api/chat, /api/generate, /api/embed (and the older /api/embeddings), /api/tags, /api/show,
/api/ps, /api/version.

OPENAPI_MODELS: the request bodies it documents in the app's OpenAPI schema.

Desktop apps and scripts that speak only Ollama's API use a worker through these routes.
A chat or a prompt becomes one engine job, prepared and submitted like every other API's;
its events are framed as Ollama's JSON lines (streaming is Ollama's default) or as one
object. The only model is the served one: it is listed as `<model id>:latest`, and any
other name is a 404, as Ollama answers for a model it does not have.

This module holds the routes and the making of a job from a chat or a prompt; running the
job and framing its answer is ollama_answer.py's, describing the model ollama_model.py's,
and the error shape with the checks every route makes first ollama_errors.py's.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from llorch.api.body import request_body
from llorch.api.errors import error_responses
from llorch.api.generation import tool_constraint
from llorch.api.ollama_answer import Shape, answer
from llorch.api.ollama_errors import OllamaError, job_error, parse_body, ready, refusal
from llorch.api.ollama_model import capabilities, check_model, details, listed_name, model_info
from llorch.api.ollama_schemas import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    ChatRequest,
    EmbedRequest,
    GenerateRequest,
    GenerationBody,
    LegacyEmbeddingsRequest,
    ShowRequest,
)
from llorch.api.pooling import pooled
from llorch.api.reasoning import reasoning_markers
from llorch.api.state import WorkerState
from llorch.api.streaming import NDJSON
from llorch.api.tool_calls import ToolFormat, new_call_id
from llorch.engine.engine import Engine
from llorch.engine.request import GenerationRequest
from llorch.weights.model_facts import ModelFacts

OPENAPI_MODELS: tuple[type[BaseModel], ...] = (ChatRequest, GenerateRequest, ShowRequest, EmbedRequest,
                                                LegacyEmbeddingsRequest)

# The Ollama release whose API these routes follow (thinking, streamed tool calls): apps gate features on it.
OLLAMA_API_VERSION = "0.9.0"
NEVER_EXPIRES = "9999-12-31T23:59:59Z"  # the model stays loaded for the worker's life

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
EMBED_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The embeddings", "content": _OBJECT},
    **error_responses(_ERROR_SCHEMA, {400: "Invalid input, or not an embedding model", 401: "Missing or wrong API key",
                                      404: "Not the served model", 413: "Body too large", 500: "Inference failed",
                                      503: "Loading, draining or busy"}),
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


# -- turning a request into a job ------------------------------------------------------------------

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
        on_gpu = engine.device.startswith("cuda")
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

    @router.post("/embed", response_model=None, openapi_extra=request_body(EmbedRequest), responses=EMBED_RESPONSES)
    async def embed(request: Request) -> Response:
        try:
            body = await parse_body(request, EmbedRequest)
            engine = ready(state)
            check_model(engine, body.model)
            texts = [body.input] if isinstance(body.input, str) else body.input
            started = time.perf_counter()
            outputs = await pooled(request, engine, [GenerationRequest("", text, 0, truncate=body.truncate)
                                                     for text in texts], refusal, job_error)
            if isinstance(outputs, Response):
                return outputs
            vectors = [unit(out.values, body.dimensions) for out in outputs]
            return JSONResponse({"model": body.model, "embeddings": vectors,
                                 "total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": 0,
                                 "prompt_eval_count": sum(out.prompt_tokens for out in outputs)})
        except OllamaError as exc:
            return exc.response()

    @router.post("/embeddings", response_model=None, openapi_extra=request_body(LegacyEmbeddingsRequest),
                 responses=EMBED_RESPONSES)
    async def embeddings(request: Request) -> Response:
        try:
            body = await parse_body(request, LegacyEmbeddingsRequest)
            engine = ready(state)
            check_model(engine, body.model)
            outputs = await pooled(request, engine, [GenerationRequest("", body.prompt, 0, truncate=True)], refusal,
                                   job_error)
            if isinstance(outputs, Response):
                return outputs
            return JSONResponse({"embedding": list(outputs[0].values)})
        except OllamaError as exc:
            return exc.response()

    return router


def unit(values: tuple[float, ...], dimensions: int | None) -> list[float]:
    """An /api/embed vector as Ollama returns it: cut to `dimensions` when asked, then of unit length."""
    vector = np.asarray(values[:dimensions] if dimensions else values, dtype=np.float64)
    return (vector / max(float(np.linalg.norm(vector)), 1e-12)).tolist()
