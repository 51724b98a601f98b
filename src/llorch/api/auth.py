"""Bearer-token auth for every endpoint but /health and /metrics, compared in constant time."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response

from llorch.api.errors import OpenAIError, speaks_openai, worker_error

OPEN_PATHS = frozenset({"/health", "/metrics"})


def install_bearer_auth(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def require_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if secrets.compare_digest(given, expected):
            return await call_next(request)
        message = "missing or wrong API key (send 'Authorization: Bearer <key>')"
        challenge = {"WWW-Authenticate": "Bearer"}
        if speaks_openai(request.url.path):
            return OpenAIError(401, message, code="invalid_api_key", kind="authentication_error",
                               headers=challenge).response()
        return worker_error(401, "authorization", "Bearer API key", message, challenge)
