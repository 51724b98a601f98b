"""The cluster's front door: the worker's own HTTP server, relaying every request to Ray's proxy.

Ray Serve's HTTP proxy has none of a worker's defences against slow clients (api/connections.py):
a client that sent half a request, or never read its answer, held its connection for as long as
it liked. So clients reach this server instead, built as a worker builds its own: the guarded
protocol (header and body read deadlines, the write deadline, eviction past --max-connections
open connections, one framing per request) and the request limit (/health and /metrics always
pass). It relays each request to Ray's proxy, which listens on loopback only, and streams the
answer back as it arrives; a client that goes away closes its upstream request, so its job is
cancelled on its replica as a direct client's would be.

It runs on a thread and event loop of its own, so the Ray driver keeps the main thread, its
signal handling and its blocking calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence

import httpx
import uvicorn
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from llorch.api.connections import RequestLimit, guarded_protocol
from llorch.api.errors import RETRY, error_for_path

log = logging.getLogger("llorch.replicas")

# Headers about one connection, not the message (RFC 9110, section 7.6.1): never relayed either way.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade", b"proxy-authenticate", b"proxy-authorization"})
# Set again on the way: httpx names the upstream host, this server answered any Expect itself, and
# Ray's proxy trusts X-Forwarded-For and -Proto from loopback (the client's address and scheme), so they
# are this server's to say, not the client's.
REQUEST_OWN = frozenset({b"host", b"expect", b"x-forwarded-for", b"x-forwarded-proto"})
RESPONSE_OWN = frozenset({b"date", b"server"})  # this server sends its own
CONNECT_TIMEOUT_S = 5.0  # a loopback connect; once connected, only the client's own deadlines apply
KEEPALIVE_EXPIRY_S = 30.0  # under Ray's proxy's 90 s, so an idle connection is dropped here first
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0


class ClientGone(Exception):
    """The client disconnected while its request body was being relayed."""


def relayed_headers(headers: Sequence[tuple[bytes, bytes]], own: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    """`headers` less the hop-by-hop ones, those the Connection header names, and `own`."""
    named = {token.strip().lower() for name, value in headers if name.lower() == b"connection"
             for token in value.split(b",")}
    return [(name, value) for name, value in headers if name.lower() not in HOP_BY_HOP | own | named]


def unreachable(path: str, reason: str) -> Response:
    return error_for_path(path, 503, f"the cluster's HTTP proxy cannot be reached ({reason}); retry shortly",
                          code="unavailable", field="worker", constraint="the cluster's HTTP proxy to answer",
                          headers=RETRY)


class Relay:
    """ASGI app: each HTTP request sent on to `upstream` (Ray's proxy), its answer streamed back as it comes."""

    def __init__(self, client: httpx.AsyncClient, upstream: httpx.URL) -> None:
        self.client, self.upstream = client, upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        body_read = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                more = message.get("more_body", False)
                yield message.get("body", b"")
            body_read.set()

        headers = dict(scope["headers"])
        has_body = b"content-length" in headers or b"transfer-encoding" in headers
        if not has_body:
            body_read.set()
        # uvicorn's send() ignores a gone client, and a non-streamed answer sends nothing for seconds:
        # only receive() tells. Cancelling the relay closes its upstream connection, and Ray's proxy
        # then cancels the job on its replica.
        answer = asyncio.ensure_future(self._answer(scope, body() if has_body else None, send))
        gone = asyncio.ensure_future(_disconnected(receive, body_read))
        try:
            await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            answer.cancel()  # a no-op once answered
            with contextlib.suppress(asyncio.CancelledError):
                await answer  # its own errors are uvicorn's to log

    async def _answer(self, scope: Scope, content: AsyncIterator[bytes] | None, send: Send) -> None:
        path = scope["path"]
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        headers = relayed_headers(scope["headers"], REQUEST_OWN)
        headers.append((b"x-forwarded-proto", scope["scheme"].encode()))
        if scope.get("client"):
            headers.append((b"x-forwarded-for", scope["client"][0].encode()))
        try:
            url = self.upstream.copy_with(raw_path=target)
        except httpx.InvalidURL:  # "*" or an absolute URL: nothing here is served at such a target
            await error_for_path(path, 400, "the request target must be a path")(scope, _nothing, send)
            return
        # A bare Request, not client.build_request: no client-wide headers or cookies from other clients.
        request = httpx.Request(scope["method"], url, headers=headers, content=content)
        try:
            upstream = await self.client.send(request, stream=True)
        except ClientGone:
            return
        except httpx.TransportError as exc:
            log.warning("Ray's HTTP proxy cannot be reached", extra={"error": repr(exc), "path": path})
            await unreachable(path, str(exc) or type(exc).__name__)(scope, _nothing, send)
            return
        try:
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": relayed_headers(upstream.headers.raw, RESPONSE_OWN)})
            async for chunk in upstream.aiter_raw():  # as it arrives: token streams stay live
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.TransportError as exc:
            # Left incomplete, the answer ends with its connection closed: a clean end would claim it whole.
            log.warning("Ray's HTTP proxy stopped mid-answer", extra={"error": repr(exc), "path": path})
        finally:
            await upstream.aclose()


async def _disconnected(receive: Receive, body_read: asyncio.Event) -> None:
    """Returns when the client has gone (or its answer is complete), once its body has been read."""
    await body_read.wait()
    while (await receive())["type"] != "http.disconnect":
        pass


async def _nothing() -> Message:  # the receive of an error answer, which reads nothing
    return {"type": "http.disconnect"}


def bind(host: str, port: int) -> socket.socket:
    """The listening address, bound now so that a taken port fails at once (OSError)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class Front:
    """The HTTP server clients reach, on a thread and event loop of its own beside the Ray driver."""

    def __init__(self, host: str, port: int, max_connections: int) -> None:
        self.sock = bind(host, port)
        # httpx logs a line per request relayed: the worker's own logs say what happened to each job.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.max_connections = max_connections
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self, upstream: str) -> bool:
        """Serve, relaying to `upstream` (http://host:port); False if the server did not start."""
        # One connection pool for the process. No overall timeout: a stream lasts as long as its job.
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S))
        config = uvicorn.Config(RequestLimit(Relay(client, httpx.URL(upstream)), self.max_connections),
                                http=guarded_protocol(self.max_connections), lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=STOP_GRACE_S)
        server = self.server = uvicorn.Server(config)

        async def serve() -> None:
            async with client:
                await server.serve(sockets=[self.sock])

        self.thread = threading.Thread(target=asyncio.run, args=(serve(),), name="llorch-front", daemon=True)
        self.thread.start()
        for _ in range(int(START_TIMEOUT_S / 0.02)):
            if server.started:
                return True
            if not self.thread.is_alive():
                break
            time.sleep(0.02)
        return False

    def wait(self) -> None:
        """Until the server stops (it does not by itself). A signal's handler raises through the sleep."""
        while self.thread is not None and self.thread.is_alive():
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop listening, let the answers under way finish for STOP_GRACE_S, and stop."""
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(STOP_GRACE_S + 5)
        self.sock.close()
