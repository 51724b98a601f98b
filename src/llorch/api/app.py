"""The worker API (DESIGN.md): GET /health, POST /execute (streamed events), POST /cancel,
plus GET /metrics (Prometheus) and the OpenAI API under /v1.

The server starts before the model is loaded, so /health can say `loading` (with
progress); every other endpoint answers 503 until the engine is attached. Handlers
validate, hand plain requests to the engine, and frame the events it sends back.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from llorch.api.auth import install_bearer_auth
from llorch.api.body import BadRequest, read_json
from llorch.api.jobs import RETRY_AFTER_S, JobStream
from llorch.api.openai import OpenAIContext, create_openai_router, openapi_components
from llorch.api.schemas import CancelRequest, ExecuteRequest, field_errors
from llorch.api.streaming import NDJSON, SSE, frame, negotiate
from llorch.engine.engine import DuplicateJob, Engine, QueueFull, RequestRejected
from llorch.engine.telemetry import Telemetry
from llorch.logs import correlation_id
from llorch.weights.chat_template import ChatTemplate

log = logging.getLogger("llorch.api")

# The events of the worker API contract; others (per-token logprobs) serve the OpenAI API.
WORKER_EVENT_TYPES = frozenset({"started", "token", "metrics", "end", "error"})
CORRELATION_HEADER = "X-Correlation-ID"


@dataclass
class WorkerState:
    """What the HTTP side knows of the worker; the engine is attached once loaded."""

    backend: str
    device: str
    telemetry: Telemetry = field(default_factory=Telemetry)
    model: str = ""
    model_id: str = ""  # the OpenAI API's model id
    engine: Engine | None = None
    chat_template: ChatTemplate | None = None
    loading_progress: float = 0.0
    draining: bool = False

    def attach(self, engine: Engine, model: str, model_id: str, chat_template: ChatTemplate | None) -> None:
        self.engine, self.model, self.model_id, self.chat_template = engine, model, model_id, chat_template
        self.loading_progress = 1.0

    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.engine is None:
            return "loading"
        return "healthy" if self.engine.alive else "unhealthy"

    def unavailable(self) -> str | None:
        """Why jobs cannot be taken now, or None when they can."""
        if self.draining:
            return "the worker is shutting down"
        if self.engine is None:
            return "the model is still loading"
        return None


def error_response(status: int, field: str, constraint: str, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    errors = [{"field": field, "constraint": constraint, "message": message}]
    return JSONResponse({"errors": errors}, status, headers=headers)


def _json_body(model: type) -> dict[str, Any]:
    """OpenAPI requestBody for a handler that parses its own body (for clients and fuzzers)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


_ERRORS_SCHEMA = {"application/json": {"schema": {"type": "object", "required": ["errors"], "properties": {
    "errors": {"type": "array", "items": {"type": "object", "required": ["field", "constraint", "message"]}}}}}}
# One server-sent event, as OpenAPI describes them: its name, and JSON in its data line.
_EVENT_SCHEMA = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"enum": sorted(WORKER_EVENT_TYPES)},
    "data": {"type": "string", "contentMediaType": "application/json"}}}
_EXECUTE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The job's events", "content": {SSE: {"schema": _EVENT_SCHEMA},
                                                          NDJSON: {"schema": {"type": "string"}}}},
    **{code: {"description": text, "content": _ERRORS_SCHEMA} for code, text in (
        (400, "Invalid request: every violation listed"), (409, "job_id already in flight"),
        (413, "Body too large"), (503, "Loading, shutting down, or the queue is full (Retry-After)"))},
}


def create_app(state: WorkerState, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="llorch worker", version="0.1.0")
    app.include_router(create_openai_router(OpenAIContext(state)))
    if api_key:
        install_bearer_auth(app, api_key)

    @app.middleware("http")
    async def correlate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        """Echo (or mint) a correlation id, and put it on every log line of this request."""
        value = request.headers.get(CORRELATION_HEADER) or uuid.uuid4().hex
        token = correlation_id.set(value[:128])
        try:
            response = await call_next(request)
        finally:
            correlation_id.reset(token)
        response.headers[CORRELATION_HEADER] = value[:128]
        return response

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        state.telemetry.requests.labels(outcome="rejected_invalid").inc()
        return JSONResponse({"errors": exc.errors}, exc.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        body: dict[str, Any] = {
            "status": state.status,
            "vram_bytes": state.engine.runner.resident_bytes if state.engine else 0,
            "backend": state.backend,
            "device": state.device,
            "model": state.model,
        }
        if state.engine is None:
            body["progress"] = round(state.loading_progress, 3)
        return body

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(generate_latest(state.telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/execute", response_model=None, openapi_extra=_json_body(ExecuteRequest),
              responses=_EXECUTE_RESPONSES)
    async def execute(request: Request) -> StreamingResponse | JSONResponse:
        why = state.unavailable()
        if why or state.engine is None:
            state.telemetry.requests.labels(outcome="rejected_unavailable").inc()
            return error_response(503, "worker", "accepting jobs", why or "unavailable",
                                  {"Retry-After": RETRY_AFTER_S})
        engine = state.engine
        try:
            parsed = ExecuteRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            state.telemetry.requests.labels(outcome="rejected_invalid").inc()
            return JSONResponse({"errors": field_errors(exc)}, 400)
        job = parsed.to_generation_request()
        try:
            prompt_ids = await run_in_threadpool(engine.prepare, job)
        except RequestRejected as exc:
            state.telemetry.requests.labels(outcome="rejected_invalid").inc()
            return error_response(400, exc.field, exc.constraint, exc.message)

        media_type = negotiate(request.headers.get("accept"))
        try:
            job_stream = JobStream(engine, job, prompt_ids)
        except DuplicateJob:
            state.telemetry.requests.labels(outcome="rejected_duplicate").inc()
            return error_response(409, "job_id", "unique among jobs in flight",
                                  f"job {job.job_id!r} is already queued or running")
        except QueueFull as exc:
            state.telemetry.requests.labels(outcome="rejected_busy").inc()
            return error_response(503, "worker", "queue not full", f"the worker is busy: {exc}",
                                  {"Retry-After": RETRY_AFTER_S})
        log.info("job submitted", extra={"job_id": job.job_id, "api": "worker"})

        async def stream() -> AsyncIterator[bytes]:
            async for event in job_stream.events():
                if event.type in WORKER_EVENT_TYPES:
                    yield frame(media_type, event.to_dict())

        return StreamingResponse(stream(), media_type=media_type,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/cancel", response_model=None, openapi_extra=_json_body(CancelRequest),
              responses={202: {"description": "Cancelling"}, 404: {"description": "Unknown job"},
                         400: {"description": "Invalid request", "content": _ERRORS_SCHEMA},
                         503: {"description": "Loading", "content": _ERRORS_SCHEMA}})
    async def cancel(request: Request) -> JSONResponse:
        try:
            parsed = CancelRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            return JSONResponse({"errors": field_errors(exc)}, 400)
        if state.engine is None:
            return error_response(503, "worker", "accepting jobs", "the model is still loading")
        if state.engine.cancel(parsed.job_id):
            log.info("cancel requested", extra={"job_id": parsed.job_id})
            return JSONResponse({"job_id": parsed.job_id, "status": "cancelling"}, 202)
        return JSONResponse({"job_id": parsed.job_id, "status": "unknown job"}, 404)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(openapi_components())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
