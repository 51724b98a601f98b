"""The worker API (DESIGN.md): GET /health, POST /execute (streamed events), POST /cancel.

The handlers validate, hand plain requests to the engine, and frame the events it
sends back. Tokenizing a prompt runs in a thread so the event loop never blocks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from llorch.api.auth import install_bearer_auth
from llorch.api.jobs import JobStream
from llorch.api.openai import OpenAIContext, create_openai_router
from llorch.api.schemas import CancelRequest, ExecuteRequest, field_errors
from llorch.api.streaming import frame, negotiate
from llorch.engine.engine import DuplicateJob, Engine, RequestRejected
from llorch.weights.chat_template import ChatTemplate

log = logging.getLogger("llorch.api")

MAX_BODY_BYTES = 1 << 20  # a 32k-character prompt in JSON is far below this
# The events of the worker API contract; others (per-token logprobs) serve the OpenAI API.
WORKER_EVENT_TYPES = frozenset({"started", "token", "metrics", "end", "error"})


@dataclass
class WorkerInfo:
    backend: str
    device: str
    model: str
    model_id: str = "model"  # the OpenAI API's model id
    draining: bool = False


class BadRequest(Exception):
    def __init__(self, status: int, errors: list[dict[str, Any]]) -> None:
        self.status = status
        self.errors = errors


def error_response(status: int, field: str, constraint: str, message: str) -> JSONResponse:
    return JSONResponse({"errors": [{"field": field, "constraint": constraint, "message": message}]}, status)


async def read_json(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BadRequest(413, [{"field": "body", "constraint": f"<= {MAX_BODY_BYTES} bytes",
                                "message": f"request body of {declared} bytes is too large"}])
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise BadRequest(413, [{"field": "body", "constraint": f"<= {MAX_BODY_BYTES} bytes",
                                    "message": "request body is too large"}])
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(400, [{"field": "body", "constraint": "valid JSON",
                                "message": f"request body is not valid JSON: {exc}"}]) from exc


def create_app(
    engine: Engine,
    info: WorkerInfo,
    chat_template: ChatTemplate | None = None,
    api_key: str | None = None,
) -> FastAPI:
    app = FastAPI(title="llorch worker", version="0.1.0")
    app.include_router(create_openai_router(OpenAIContext(engine, info.model_id, chat_template), read_json))
    if api_key:
        install_bearer_auth(app, api_key)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"errors": exc.errors}, exc.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        status = "draining" if info.draining else "healthy" if engine.alive else "unhealthy"
        return {
            "status": status,
            "vram_bytes": engine.runner.resident_bytes,
            "backend": info.backend,
            "device": info.device,
            "model": info.model,
        }

    @app.post("/execute", response_model=None)
    async def execute(request: Request) -> StreamingResponse | JSONResponse:
        if info.draining:
            return error_response(503, "worker", "accepting jobs", "the worker is draining")
        try:
            parsed = ExecuteRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            return JSONResponse({"errors": field_errors(exc)}, 400)
        job = parsed.to_generation_request()
        try:
            prompt_ids = await run_in_threadpool(engine.prepare, job)
        except RequestRejected as exc:
            return error_response(400, exc.field, exc.constraint, exc.message)

        media_type = negotiate(request.headers.get("accept"))
        try:
            job_stream = JobStream(engine, job, prompt_ids)
        except DuplicateJob:
            return error_response(409, "job_id", "unique among jobs in flight",
                                  f"job {job.job_id!r} is already queued or running")

        async def stream() -> AsyncIterator[bytes]:
            async for event in job_stream.events():
                if event.type in WORKER_EVENT_TYPES:
                    yield frame(media_type, event.to_dict())

        return StreamingResponse(stream(), media_type=media_type,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/cancel", response_model=None)
    async def cancel(request: Request) -> JSONResponse:
        try:
            parsed = CancelRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            return JSONResponse({"errors": field_errors(exc)}, 400)
        if engine.cancel(parsed.job_id):
            log.info("cancel requested", extra={"job_id": parsed.job_id})
            return JSONResponse({"job_id": parsed.job_id, "status": "cancelling"}, 202)
        return JSONResponse({"job_id": parsed.job_id, "status": "unknown job"}, 404)

    return app
