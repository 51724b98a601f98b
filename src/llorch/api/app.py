"""The worker API (DESIGN.md): GET /health, POST /execute (streamed events), POST /cancel,
plus GET /metrics (Prometheus), the OpenAI API under /v1 (and at the root, as llama-server
serves it), Anthropic's, Ollama's and llama-server's own routes.

The server starts before the model is loaded, so /health can say `loading` (with
progress); every other endpoint answers 503 until the engine is attached. Handlers
validate, hand plain requests to the engine's front door, and frame the events it
sends back.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from llorch.api import anthropic, llama_server, ollama, openai, pooling, responses, tokenizer_routes
from llorch.api.anthropic import create_anthropic_router
from llorch.api.auth import install_bearer_auth
from llorch.api.body import BadRequest, openapi_components, openapi_json_body, read_json
from llorch.api.correlation import Correlation
from llorch.api.cors import install_cors
from llorch.api.errors import (
    RETRY,
    WORKER_ERROR_SCHEMA,
    error_for_path,
    error_responses,
    worker_error,
    worker_errors,
    worker_refusal,
)
from llorch.api.jobs import JobStream
from llorch.api.llama_server import create_llama_server_router
from llorch.api.ollama import create_ollama_router
from llorch.api.openai import create_openai_router
from llorch.api.page import create_page_router
from llorch.api.pooling import create_pooling_router
from llorch.api.responses import create_responses_router
from llorch.api.socket_body import socket_body
from llorch.api.state import WorkerState
from llorch.api.streaming import NDJSON, SSE, frame, negotiate
from llorch.api.tokenizer_routes import create_tokenizer_router
from llorch.api.worker_schemas import CancelRequest, ExecuteRequest, field_errors
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import Event

# The events of the worker API contract; others (per-token logprobs) serve the OpenAI API.
WORKER_EVENT_TYPES = frozenset({"started", "token", "metrics", "end", "error"})
OPENAI_PREFIX = "/v1"


# One server-sent event, as OpenAPI describes them: its name, and JSON in its data line.
_EVENT_SCHEMA = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"enum": sorted(WORKER_EVENT_TYPES)},
    "data": {"type": "string", "contentMediaType": "application/json"}}}
_EXECUTE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The job's events", "content": {SSE: {"schema": _EVENT_SCHEMA},
                                                          NDJSON: {"schema": {"type": "string"}}}},
    **error_responses(WORKER_ERROR_SCHEMA, {
        400: "Invalid request: every violation listed", 409: "job_id already in flight", 413: "Body too large",
        503: "Loading, shutting down, or the queue is full (Retry-After)"}),
}
_CANCEL_RESPONSES: dict[int | str, dict[str, Any]] = {
    202: {"description": "Cancelling"}, 404: {"description": "Unknown job"},
    **error_responses(WORKER_ERROR_SCHEMA, {400: "Invalid request", 503: "Loading"}),
}


def create_app(state: WorkerState, api_key: str | None = None, cors_origins: list[str] | None = None,
               slots: bool = False) -> FastAPI:
    """The worker's app; `cors_origins` as cors.parse_origins gives them (None: pages on localhost);
    `slots` serves llama-server's GET /slots (--slots)."""
    # No /docs or /redoc: their pages load scripts from a CDN, which a machine without internet cannot reach.
    app = FastAPI(title="llorch worker", version="0.1.0", docs_url=None, redoc_url=None)
    app.include_router(create_anthropic_router(state))  # before the OpenAI routers: both live under /v1
    # The OpenAI routes again without the prefix, as llama-server serves them (clients whose base URL has no
    # /v1): a route added to these routers gets its alias here; errors.family_of gives them OpenAI's shape.
    for router in (create_responses_router(state), create_openai_router(state), create_pooling_router(state)):
        app.include_router(router, prefix=OPENAI_PREFIX)
        app.include_router(router, include_in_schema=False)
    app.include_router(create_tokenizer_router(state))
    app.include_router(create_llama_server_router(state, slots))
    app.include_router(create_ollama_router(state))
    app.include_router(create_page_router())
    if api_key:
        install_bearer_auth(app, api_key)

    app.add_middleware(Correlation)

    def rejected(response: JSONResponse, outcome: str) -> JSONResponse:
        state.telemetry.requests.labels(outcome=outcome).inc()
        return response

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and methods answer in the API's own error shape, not the framework's."""
        message = f"{request.method} {request.url.path[:200]}: {exc.detail}"
        return error_for_path(request.url.path, exc.status_code, message,
                              code="not_found" if exc.status_code == 404 else None, field="path",
                              constraint="a route of this API", headers=exc.headers)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return rejected(worker_errors(exc.status, exc.errors), "rejected_invalid")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return state.health()

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(generate_latest(state.telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/execute", response_model=None, openapi_extra=openapi_json_body(ExecuteRequest),
              responses=_EXECUTE_RESPONSES)
    async def execute(request: Request) -> StreamingResponse | JSONResponse:
        why = state.unavailable()
        if why or state.engine is None:
            return rejected(worker_error(503, "worker", "accepting jobs", why or "unavailable", RETRY),
                            "rejected_unavailable")
        engine = state.engine
        try:
            parsed = ExecuteRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            return rejected(worker_errors(400, field_errors(exc)), "rejected_invalid")
        media_type = negotiate(request.headers.get("accept"))

        def framed(event: Event) -> bytes:
            return frame(media_type, event.to_dict()) if event.type in WORKER_EVENT_TYPES else b""

        try:
            job = await run_in_threadpool(engine.prepare, parsed.to_generation_request())
            job_stream = JobStream(engine, job)
        except EngineRefusal as exc:
            response = worker_refusal(exc)
            outcome = {400: "rejected_invalid", 409: "rejected_duplicate"}.get(response.status_code, "rejected_busy")
            return rejected(response, outcome)
        return StreamingResponse(job_stream.frames(framed, socket_body(request)), media_type=media_type,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/cancel", response_model=None, openapi_extra=openapi_json_body(CancelRequest),
              responses=_CANCEL_RESPONSES)
    async def cancel(request: Request) -> JSONResponse:
        try:
            parsed = CancelRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            return worker_errors(400, field_errors(exc))
        if state.engine is None:
            return worker_error(503, "worker", "accepting jobs", "the model is still loading")
        if state.engine.cancel(parsed.job_id):
            return JSONResponse({"job_id": parsed.job_id, "status": "cancelling"}, 202)
        return JSONResponse({"job_id": parsed.job_id, "status": "unknown job"}, 404)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            documented = (openai.OPENAPI_MODELS + anthropic.OPENAPI_MODELS + responses.OPENAPI_MODELS
                          + ollama.OPENAPI_MODELS + tokenizer_routes.OPENAPI_MODELS + llama_server.OPENAPI_MODELS
                          + pooling.OPENAPI_MODELS)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components(documented))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    install_cors(app, cors_origins)
    return app
