"""A streamed answer's chunks written to its socket by the engine thread, not the event loop.

Why: a streamed token that goes through the event loop costs that thread about 0.2 ms of CPU
(waking it, a queue and a task switch, the ASGI send chain, then the socket write) and, on a
two-core machine, the loop takes it from the decode step's threads, which hold both cores. The
engine thread, between two steps, writes the same bytes in one system call: the loop is not woken
at all while a job streams, only for its end.

Only where it is safe, else the caller falls back to the loop's ordinary path for the rest of
the answer: plain TCP (no TLS), an HTTP/1.1 answer framed in chunks, nothing left in the
transport's buffer, and a socket that takes every byte at once. A socket that is full (a slow
reader) or gone hands what it did not take back to the loop, where the write deadline and the
disconnect handling live (connections.py).

Own chunk framing, not h11's: h11's connection is the loop's, and a chunk is its size in hex, a
line break, the bytes and a line break (RFC 9112, section 7.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

from starlette.requests import Request

EXTENSION = "llorch.socket_body"  # the scope["extensions"] key the protocol offers a SocketBody under


def socket_body(request: Request) -> SocketBody | None:
    """The server's direct path for this request's answer, where it offers one."""
    return request.scope.get("extensions", {}).get(EXTENSION)


class SocketBody:
    """One answer's direct path to its socket: opened on the loop once the headers are out, written from the
    engine thread, closed on the loop when the answer ends."""

    def __init__(self, transport: asyncio.Transport, chunked: bool) -> None:
        self._transport = transport
        self._chunked = chunked
        self._fd = -1
        self._lock = threading.Lock()  # the engine thread writes, the loop opens and closes

    def open(self) -> bool:
        """On the loop, with nothing of the answer pending: take a descriptor of our own for the socket (the
        loop's may be closed and reused meanwhile; ours keeps naming this connection). False where the
        direct path cannot be used."""
        transport = self._transport
        if not self._chunked or transport.is_closing() or transport.get_write_buffer_size():
            return False
        if transport.get_extra_info("sslcontext") is not None:
            return False
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            fd = os.dup(sock.fileno())
        except OSError:
            return False
        if os.get_blocking(fd):  # a full socket would stop the engine: only a non-blocking one will do
            os.close(fd)
            return False
        with self._lock:
            self._fd = fd
        return True

    def write(self, data: bytes) -> bytes | None:
        """From any thread: `data` as one chunk of the answer. None when the socket took it all; otherwise the
        framed bytes it did not take, which the loop must write (write_rest) before anything else."""
        framed = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        with self._lock:
            if self._fd < 0:
                return framed
            try:
                sent = os.write(self._fd, framed)
            except OSError:  # full (a slow reader) or gone: the loop learns which from the socket
                sent = 0
            if sent == len(framed):
                return None
            self._close_locked()
            return framed[sent:]

    def write_rest(self, framed: bytes) -> None:
        """On the loop: bytes already framed as a chunk (what the socket did not take), through the transport."""
        if not self._transport.is_closing():
            self._transport.write(framed)

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
