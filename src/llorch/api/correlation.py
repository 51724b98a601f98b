"""Every request's correlation id: echoed (or minted), and on every log line of that request.

A plain ASGI middleware, not a `@app.middleware("http")` function: that kind passes each
streamed chunk through a memory stream and a second task, about 0.1 ms of the event loop's
time per streamed token, which the decode step's threads then lose on a two-core machine.
"""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llorch.logs import correlation_id

CORRELATION_HEADER = "X-Correlation-ID"
MAX_ID_CHARS = 128


class Correlation:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = (Headers(scope=scope).get(CORRELATION_HEADER) or uuid.uuid4().hex)[:MAX_ID_CHARS]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[CORRELATION_HEADER] = value
            await send(message)

        token = correlation_id.set(value)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            correlation_id.reset(token)
