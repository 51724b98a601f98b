"""Error responses: one body builder per API shape, and one mapping from engine refusals to each.

- worker API: `{"errors": [{"field", "constraint", "message", "value"?}, ...]}`;
- OpenAI API: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from llorch.engine.errors import DuplicateJob, EngineRefusal, QueueFull, RequestRejected
from llorch.engine.request import Error, ErrorCode

# Root endpoints that answer in OpenAI's error shape, like /v1/*.
OPENAI_SHAPED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
RETRY_AFTER_S = "1"  # a busy, loading or draining worker: try again (or another worker) shortly
RETRY = {"Retry-After": RETRY_AFTER_S}


def speaks_openai(path: str) -> bool:
    """Whether errors on `path` take OpenAI's shape (else the worker API's)."""
    return path.startswith("/v1/") or path in OPENAI_SHAPED_PATHS


def worker_error(status: int, field: str, constraint: str, message: str,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    return worker_errors(status, [{"field": field, "constraint": constraint, "message": message}], headers)


def worker_errors(status: int, errors: list[dict[str, Any]], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"errors": errors}, status, headers=headers)


def worker_refusal(exc: EngineRefusal) -> JSONResponse:
    """An engine refusal in the worker API's shape."""
    if isinstance(exc, RequestRejected):
        return worker_error(400, exc.field, exc.constraint, exc.message)
    if isinstance(exc, DuplicateJob):
        return worker_error(409, "job_id", "unique among jobs in flight", f"job {exc} is already queued or running")
    if isinstance(exc, QueueFull):
        return worker_error(503, "worker", "queue not full", f"the worker is busy: {exc}", RETRY)
    raise TypeError(f"unmapped refusal {type(exc).__name__}")


class OpenAIError(Exception):
    """An error answer in OpenAI's shape, raised from a handler and turned into its response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def openai_refusal(exc: EngineRefusal) -> OpenAIError:
    """An engine refusal in OpenAI's shape."""
    if isinstance(exc, RequestRejected):
        return OpenAIError(400, exc.message, param=exc.field, code=exc.code)
    if isinstance(exc, QueueFull):
        return OpenAIError(503, f"The worker is busy: {exc}. Retry shortly.", kind="server_error",
                           code="server_busy", headers=RETRY)
    if isinstance(exc, DuplicateJob):  # request ids are random: a collision is the server's fault
        return OpenAIError(500, "job id collision", kind="server_error")
    raise TypeError(f"unmapped refusal {type(exc).__name__}")


def openai_job_error(event: Error) -> OpenAIError:
    """A job's terminal error event in OpenAI's shape."""
    if event.code is ErrorCode.VRAM_OOM:
        return OpenAIError(503, event.message, code="out_of_memory", kind="server_error")
    if event.code is ErrorCode.CANCELLED:  # the worker is draining (or the job was cancelled): try elsewhere
        return OpenAIError(503, f"The job was cancelled: {event.message}", code="cancelled", kind="server_error",
                           headers=RETRY)
    return OpenAIError(500, event.message, code=event.code.value.lower(), kind="server_error")


# OpenAPI descriptions of the two error bodies, for the response tables.
WORKER_ERROR_SCHEMA = {"application/json": {"schema": {"type": "object", "required": ["errors"], "properties": {
    "errors": {"type": "array", "items": {"type": "object", "required": ["field", "constraint", "message"]}}}}}}
OPENAI_ERROR_SCHEMA = {"application/json": {"schema": {"type": "object", "required": ["error"], "properties": {
    "error": {"type": "object", "required": ["message", "type"]}}}}}


def error_responses(schema: dict[str, Any], statuses: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for error statuses, all with the same body schema."""
    return {status: {"description": text, "content": schema} for status, text in statuses.items()}
