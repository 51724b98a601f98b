"""API-key auth for every endpoint but /health, /metrics and the chat page, compared in constant time.

The key comes as `Authorization: Bearer KEY` (OpenAI's clients, the worker API) or as
`x-api-key: KEY` (Anthropic's clients); either is enough.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response

from llorch.api.errors import error_for_path

# The chat page and its icon hold no data; the page asks for the key and sends it with each API call.
OPEN_PATHS = frozenset({"/health", "/metrics", "/", "/favicon.ico"})


def install_bearer_auth(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode()
    expected_header_key = api_key.encode()

    @app.middleware("http")
    async def require_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        bearer = request.headers.get("authorization", "").encode()
        header_key = request.headers.get("x-api-key", "").encode()
        # Both compared every time: how long the check takes says nothing about which one was close.
        bearer_ok = secrets.compare_digest(bearer, expected)
        header_ok = secrets.compare_digest(header_key, expected_header_key)
        if bearer_ok or header_ok:
            return await call_next(request)
        message = "missing or wrong API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')"
        return error_for_path(request.url.path, 401, message, code="invalid_api_key", field="authorization",
                              constraint="API key", headers={"WWW-Authenticate": "Bearer"})
