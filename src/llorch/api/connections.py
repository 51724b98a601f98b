"""Slow and idle clients cannot hold the server: read and write deadlines, idle eviction, a request
limit, and one framing of a request body.

uvicorn waits for a request's headers and body as long as the client likes, and for the
client to read its answer as long as it likes; its concurrency limit counts idle
connections too. So 256 connections that send half a request made every request, /health
included, a 503, and eight that never read a large answer held eight request slots for
good. Here instead:
- a request's headers must arrive within HEADER_TIMEOUT_S of its first byte (or of the
  connection), and its body within BODY_TIMEOUT_S of its headers; neither deadline
  moves when more bytes trickle in, so a drip-feed does not extend it;
- a client must keep taking its answer: once the worker's send buffers are full (the
  kernel's, capped at SEND_BUFFER_BYTES instead of growing to 4 MiB, then asyncio's,
  which pauses writing past 64 KiB), the client has WRITE_TIMEOUT_S to read them down
  (to 16 KiB) or the connection is reset, the buffered answer dropped, and its job
  cancelled like any disconnect's;
- past `max_open` connections, each new one closes the oldest connection that is
  not being answered (idle, or still sending its request), else the one whose client
  has left its answer unread longest, so neither crowd locks out a real client;
- `--max-connections` bounds the requests being answered at once (streams included);
  beyond it a request gets a 503 in its API's shape. /health and /metrics are never
  refused;
- a request that carries both Content-Length and Transfer-Encoding is refused with a 400
  before anything reads it: servers and proxies that disagree on which one frames the
  body are how requests are smuggled past a proxy (RFC 9112, section 6.3).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from llorch.api.auth import OPEN_PATHS
from llorch.api.errors import RETRY, error_for_path
from llorch.api.socket_body import EXTENSION, SocketBody

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0  # a 1 MiB body at 35 KB/s
WRITE_TIMEOUT_S = 30.0  # a full send buffer (48 KiB to drain) left unread this long: the client is gone
# The kernel's share of an unread answer (Linux doubles it). Autotuned, it grows to 4 MiB per connection on
# loopback, so an answer that size sits there unread with no deadline; 256 KiB still fills any link's
# round trip at token-stream rates.
SEND_BUFFER_BYTES = 256 << 10
BOTH_FRAMINGS = ("a request may not carry both Content-Length and Transfer-Encoding: they disagree on where "
                 "its body ends (RFC 9112, section 6.3)")


class OneFraming(h11.Connection):
    """h11's server side, refusing a request that frames its body twice (h11 would read it as chunked)."""

    refused: str | None = None  # why the last request was refused, for the 400's body

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}  # h11 lower-cases header names
            if b"content-length" in names and b"transfer-encoding" in names:
                self.refused = BOTH_FRAMINGS
                raise h11.RemoteProtocolError(BOTH_FRAMINGS, error_status_hint=400)
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with read and write deadlines, eviction and one framing (see the module doc)."""

    max_open = 256  # set per server by `guarded_protocol`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.config.h11_max_incomplete_event_size
        self.conn = OneFraming(h11.SERVER, **({} if limit is None else {"max_incomplete_event_size": limit}))

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # a client already gone
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self.opened_at = time.monotonic()
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_for: object = None  # the h11 state the deadline is for
        self._write_deadline: asyncio.TimerHandle | None = None
        self.unread_since: float | None = None  # when the send buffer filled up and the client stopped reading
        self._watch_reading()
        self._evict_idle()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_reading()

    def handle_events(self) -> None:
        """uvicorn's, then each new request's scope offers the engine thread a direct path to the socket."""
        super().handle_events()
        scope = getattr(self, "scope", None)
        if scope is not None and EXTENSION not in scope.setdefault("extensions", {}):
            chunked = scope["http_version"] == "1.1" and scope["method"] != "HEAD"
            scope["extensions"][EXTENSION] = SocketBody(self.transport, chunked)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._cancel_write_deadline()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The send buffer is full: the client has WRITE_TIMEOUT_S to read it down."""
        super().pause_writing()
        if self._write_deadline is None:
            self.unread_since = time.monotonic()
            self._write_deadline = self.loop.call_later(WRITE_TIMEOUT_S, self._answer_unread)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_deadline()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for a request h11 refuses, saying why when the reason is ours."""
        refused = getattr(self.conn, "refused", None)
        if refused:
            self.logger.info("refusing a request: %s", refused)
        super().send_400_response(refused or msg)

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

    def _cancel_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
        self._write_deadline, self.unread_since = None, None

    def _answer_unread(self) -> None:
        self._write_deadline = None
        self.logger.info("resetting a connection whose client left its answer unread for %g s", WRITE_TIMEOUT_S)
        self.reset()

    def reset(self) -> None:
        """Drop the connection and everything buffered for it, here and in the kernel.

        close() would wait for the client to read the buffer, which is what it does not do;
        abort() drops asyncio's buffer, and a zero linger makes the kernel send a reset
        instead of keeping its own copy of the answer for the client.
        """
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # already gone
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _evict_idle(self) -> None:
        if len(self.connections) <= self.max_open:
            return
        others = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)]
        idle = [c for c in others if c.reading_request]
        if idle:
            oldest = min(idle, key=lambda c: c.opened_at)
            oldest.transport.close()
            return
        unread = [c for c in others if c.unread_since is not None]
        if unread:
            longest = min(unread, key=lambda c: c.unread_since or 0.0)
            self.logger.info("%d connections are open: resetting the one whose client has left its answer unread "
                             "longest (%.0f s)", len(self.connections), time.monotonic() - (longest.unread_since or 0))
            longest.reset()


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
