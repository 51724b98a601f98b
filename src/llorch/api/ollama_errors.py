"""Ollama's error answer, `{"error": message}`, and the checks every Ollama route makes first.

Apart from the routes because the answer's framing (ollama_answer.py) and the model checks
(ollama_model.py) raise the same error: a body that is not JSON or not valid, a worker not
ready, an engine's refusal or a job's error, each in Ollama's shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from llorch.api.body import BadRequest, read_json
from llorch.api.errors import RETRY, job_error_parts, refusal_parts
from llorch.api.state import WorkerState
from llorch.api.violations import one_message
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import Error

# The engine's field names, as this API calls them.
FIELD_NAMES = {"max_tokens": "options.num_predict", "tools": "tools", "format": "format"}


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


def refusal(exc: EngineRefusal) -> OllamaError:
    return OllamaError(*refusal_parts(exc, FIELD_NAMES))


def job_error(event: Error) -> OllamaError:
    return OllamaError(*job_error_parts(event))
