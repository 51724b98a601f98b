"""llama-server's own API: POST /completion, GET /props, GET /slots, POST /apply-template.

OPENAPI_MODELS: the request bodies it documents in the app's OpenAPI schema.

Tools written for llama.cpp's server (its web UI, editor plugins, scripts) call these routes;
with them and the OpenAI routes at the root, a worker stands in for llama-server. A
/completion is one engine job, prepared and submitted like every other API's, its events
framed as llama-server's objects (streamed as `data:` lines with no `[DONE]`, as llama-server
sends them). Errors are in llama-server's shape. /slots lists the jobs in flight and is off
unless the worker runs with --slots, as in llama-server.

This module holds the routes, /props and /slots; running a /completion job and framing its
answer is llama_server_completion.py's.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from llorch import __version__
from llorch.api.body import BadRequest, read_json, request_body
from llorch.api.errors import LLAMA_SERVER_ERROR_SCHEMA, RETRY, LlamaServerError, error_responses
from llorch.api.llama_server_completion import complete, refusal
from llorch.api.llama_server_completion_schemas import LlamaCompletionRequest
from llorch.api.llama_server_schemas import ApplyTemplateRequest
from llorch.api.state import WorkerState
from llorch.api.tokenizer_routes import render
from llorch.api.violations import one_message
from llorch.engine.engine import Engine
from llorch.engine.errors import RequestRejected

OPENAPI_MODELS: tuple[type[BaseModel], ...] = (LlamaCompletionRequest, ApplyTemplateRequest)
SLOTS_OFF = "This server does not support slots endpoint. Start it with `--slots`"

_OBJECT = {"application/json": {"schema": {"type": "object"}}}
_BODY_ERRORS = {400: "Invalid or unsupported parameters", 401: "Missing or wrong API key", 413: "Body too large",
                415: "Compressed body"}


def documented(ok: str, content: dict[str, Any], errors: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": ok, "content": content}, **error_responses(LLAMA_SERVER_ERROR_SCHEMA, errors)}


COMPLETION_RESPONSES = documented(
    "The completion, or its chunks as `data:` lines when stream is true",
    # Each server-sent event, as a client reads it: a `data:` line of JSON text.
    {**_OBJECT, "text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                 "properties": {"data": {"type": "string"}}}}},
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
