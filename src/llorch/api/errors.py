"""Error responses: one body builder per API family, and one mapping from engine refusals to each.

- worker API: `{"errors": [{"field", "constraint", "message", "value"?}, ...]}`;
- OpenAI API (`/v1/*` and the tokenizer routes): `{"error": {"message", "type", "param", "code"}}`;
- Anthropic Messages (`/v1/messages*`): `{"type": "error", "error": {"type", "message"}}`;
- Ollama (`/api/*`): `{"error": "message"}`;
- llama-server's own routes (`/completion`, `/props`, `/slots`, `/apply-template`):
  `{"error": {"code", "message", "type"}}`.

Every route answers in its family's shape, errors raised before a handler runs (auth, an
unknown route, a busy server) included: `error_for_path` picks the shape from the path.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from llorch.engine.errors import DuplicateJob, EngineRefusal, QueueFull, RequestRejected
from llorch.engine.request import Error, ErrorCode

# Root endpoints that answer in OpenAI's error shape, like /v1/*.
OPENAI_SHAPED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
# First path segments of the OpenAI routes, which are served at the root as well as under /v1 (app.py
# includes the OpenAI routers twice, as llama-server serves them): their errors are OpenAI's there too.
OPENAI_ROOT_SEGMENTS = frozenset({"chat", "completions", "responses", "models", "embeddings", "rerank"})
# llama-server's own routes, with its error shape.
LLAMA_SERVER_PATHS = frozenset({"/completion", "/props", "/slots", "/apply-template"})
RETRY_AFTER_S = "1"  # a busy, loading or draining worker: try again (or another worker) shortly
RETRY = {"Retry-After": RETRY_AFTER_S}


ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"


def family_of(path: str) -> str:
    """The API family whose error shape `path` answers in: "anthropic", "ollama", "openai", "llama-server"
    or "worker"."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return "anthropic"
    if path.startswith(OLLAMA_PREFIX):
        return "ollama"
    first_segment = path.split("/", 2)[1] if path.startswith("/") else ""
    if path.startswith("/v1/") or path in OPENAI_SHAPED_PATHS or first_segment in OPENAI_ROOT_SEGMENTS:
        return "openai"
    if path in LLAMA_SERVER_PATHS or path.startswith("/slots/"):
        return "llama-server"
    return "worker"


def error_for_path(path: str, status: int, message: str, *, code: str | None = None, kind: str | None = None,
                   field: str = "request", constraint: str = "valid", headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    """An error answer in the shape of `path`'s API family.

    `code` and `kind` are OpenAI's (`kind` defaults by status); `field` and `constraint` the worker API's.
    """
    family = family_of(path)
    if family == "anthropic":
        return AnthropicError(status, message, headers=headers).response()
    if family == "ollama":
        return JSONResponse({"error": message}, status, headers=headers)
    if family == "llama-server":
        return LlamaServerError(status, message, headers=headers).response()
    if family == "openai":
        default_kind = "server_error" if status >= 500 else ("authentication_error" if status == 401
                                                              else "invalid_request_error")
        return OpenAIError(status, message, code=code, kind=kind or default_kind, headers=headers).response()
    return worker_error(status, field, constraint, message, headers)


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


def refusal_parts(exc: EngineRefusal, field_names: dict[str, str] | None = None
                  ) -> tuple[int, str, dict[str, str] | None]:
    """An engine refusal as status, message and headers: the families whose error is a status and a message
    (Ollama's, llama-server's) build theirs from it. `field_names`: the engine's field names as the API says them."""
    if isinstance(exc, RequestRejected):
        return 400, f"{(field_names or {}).get(exc.field, exc.field)}: {exc.message}", None
    if isinstance(exc, QueueFull):
        return 503, f"the worker is busy: {exc}; retry shortly", RETRY
    if isinstance(exc, DuplicateJob):  # job ids are random: a collision is the server's fault
        return 500, "job id collision", None
    raise TypeError(f"unmapped refusal {type(exc).__name__}")


def job_error_parts(event: Error) -> tuple[int, str, dict[str, str] | None]:
    """A job's terminal error event as status, message and headers (see refusal_parts)."""
    if event.code is ErrorCode.VRAM_OOM:
        return 503, event.message, None
    if event.code is ErrorCode.CANCELLED:  # the worker is draining: try again (elsewhere)
        return 503, f"the job was cancelled: {event.message}", RETRY
    return 500, event.message, None


# Anthropic's error types by HTTP status (its documented mapping; 503 stands in for its 529 "overloaded").
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         503: "overloaded_error", 529: "overloaded_error"}


class AnthropicError(Exception):
    """An error answer in Anthropic's shape, raised from a handler and turned into its response."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers
        self.kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.kind, "message": self.message}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


# llama-server's error types by HTTP status.
LLAMA_SERVER_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                            404: "not_found_error", 500: "server_error", 501: "not_supported_error",
                            503: "unavailable_error"}


class LlamaServerError(Exception):
    """An error answer in llama-server's shape, raised from a handler and turned into its response."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers
        self.kind = LLAMA_SERVER_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.kind}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


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
LLAMA_SERVER_ERROR_SCHEMA = {"application/json": {"schema": {"type": "object", "required": ["error"], "properties": {
    "error": {"type": "object", "required": ["code", "message", "type"]}}}}}
ANTHROPIC_ERROR_SCHEMA = {"application/json": {"schema": {
    "type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"]}}}}}


def error_responses(schema: dict[str, Any], statuses: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for error statuses, all with the same body schema."""
    return {status: {"description": text, "content": schema} for status, text in statuses.items()}
