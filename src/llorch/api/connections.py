"""Slow and idle clients cannot hold the server: read deadlines, idle eviction, a request limit.

uvicorn waits for a request's headers and body as long as the client likes, and its
concurrency limit counts idle connections too, so 256 connections that send half a
request made every request, /health included, a 503. Here instead:
- a request's headers must arrive within HEADER_TIMEOUT_S of its first byte (or of the
  connection), and its body within BODY_TIMEOUT_S of its headers; neither deadline
  moves when more bytes trickle in, so a drip-feed does not extend it;
- past `max_open` connections, each new one closes the oldest connection that is
  not being answered (idle, or still sending its request), so a crowd of idle
  connections never locks out a real client;
- `--max-connections` bounds the requests being answered at once (streams included);
  beyond it a request gets a 503 in its API's shape. /health and /metrics are never
  refused.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from llorch.api.auth import OPEN_PATHS
from llorch.api.errors import RETRY, error_for_path

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0  # a 1 MiB body at 35 KB/s


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with read deadlines and idle eviction (see the module doc)."""

    max_open = 256  # set per server by `guarded_protocol`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened_at = time.monotonic()
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_for: object = None  # the h11 state the deadline is for
        self._watch_reading()
        self._evict_idle()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    @property
    def reading_request(self) -> bool:
        """Waiting for a request, or for the rest of one: nothing of ours is being answered yet."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing()

    def _watch_reading(self) -> None:
        """One deadline per phase: headers (their IDLE), then body (their SEND_BODY); none once it is all here."""
        if not self.reading_request:
            self._cancel_deadline()
            return
        state = self.conn.their_state
        if state is h11.IDLE and self.timeout_keep_alive_task is not None:
            return  # between requests: uvicorn's keep-alive timeout closes it
        if self._deadline_for is state:
            return  # the phase's deadline runs on; more bytes do not move it
        self._cancel_deadline()
        timeout = HEADER_TIMEOUT_S if state is h11.IDLE else BODY_TIMEOUT_S
        self._deadline = self.loop.call_later(timeout, self._read_too_slow)
        self._deadline_for = state

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_for = None, None

    def _read_too_slow(self) -> None:
        self._deadline, self._deadline_for = None, None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request did not arrive in time")
            self.transport.close()

    def _evict_idle(self) -> None:
        if len(self.connections) <= self.max_open:
            return
        idle = [c for c in self.connections
                if c is not self and isinstance(c, GuardedH11Protocol) and c.reading_request]
        if idle:
            oldest = min(idle, key=lambda c: c.opened_at)
            oldest.transport.close()


def guarded_protocol(max_open: int) -> type[GuardedH11Protocol]:
    """The protocol class for one server (uvicorn builds it from the class alone)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"max_open": max_open})


class RequestLimit:
    """At most `max_requests` requests answered at once; /health and /metrics always pass."""

    def __init__(self, app: ASGIApp, max_requests: int) -> None:
        self.app, self.max_requests = app, max_requests
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.active >= self.max_requests:
            await self._busy(scope["path"])(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1

    def _busy(self, path: str) -> Any:
        message = (f"the worker is answering {self.max_requests} requests already (--max-connections); "
                   "retry shortly")
        return error_for_path(path, 503, message, code="server_busy", field="worker",
                              constraint=f"at most {self.max_requests} requests at once", headers=RETRY)
