"""API-key auth for every endpoint but /health, /metrics and the chat page, compared in constant time.

The key comes as `Authorization: Bearer KEY` (OpenAI's clients, the worker API) or as
`x-api-key: KEY` (Anthropic's clients); either is enough.
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from llorch.api.errors import error_for_path

# The chat page and its icon hold no data; the page asks for the key and sends it with each API call.
OPEN_PATHS = frozenset({"/health", "/metrics", "/", "/favicon.ico"})


def install_bearer_auth(app: FastAPI, api_key: str) -> None:
    app.add_middleware(BearerAuth, api_key=api_key)


class BearerAuth:
    """A plain ASGI middleware (see correlation.py for why not an `@app.middleware` function)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_header_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if self.allowed(request):
            await self.app(scope, receive, send)
            return
        message = "missing or wrong API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')"
        response = error_for_path(request.url.path, 401, message, code="invalid_api_key",
                                  field="authorization", constraint="API key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def allowed(self, request: Request) -> bool:
        if request.url.path in OPEN_PATHS:
            return True
        bearer = request.headers.get("authorization", "").encode()
        header_key = request.headers.get("x-api-key", "").encode()
        # Both compared every time: how long the check takes says nothing about which one was close.
        bearer_ok = secrets.compare_digest(bearer, self.expected)
        header_ok = secrets.compare_digest(header_key, self.expected_header_key)
        return bearer_ok or header_ok
