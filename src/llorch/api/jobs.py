"""Bridge from the engine thread to an HTTP handler: submit a prepared job, await its events.

Every API submits through here, so there is one generation path.
A stream that is abandoned before its terminal event cancels its job; one whose reader falls
behind holds its job until it catches up.

A stream read through `frames` (the API's bytes for one event, the one function both paths frame
with) may be written by the engine thread itself once its handler has sent everything before
(socket_body.py says why and when): its events then never wake the event loop, until the terminal
one, which the handler frames and ends the answer with as before. The first write the socket
does not take whole ends that for the stream: what is left of it, and every event after, go
through the loop in order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from llorch.api.socket_body import SocketBody
from llorch.engine.engine import Engine
from llorch.engine.request import Event, PreparedJob

log = logging.getLogger("llorch.api")

# An event's bytes on the wire; empty for an event this answer does not carry.
Framer = Callable[[Event], bytes]


class JobStream:
    def __init__(self, engine: Engine, job: PreparedJob) -> None:
        """Submit the job now (raises the engine's refusals); its events are read with `events()`."""
        self.engine = engine
        self.job_id = job.request.job_id
        self._queue: asyncio.Queue[Event | bytes] = asyncio.Queue()
        # Events emitted and taken, each counted by one thread only: their difference is what the reader
        # has left untaken, which holds the job (Engine.submit) when the client stops reading.
        self._emitted = self._taken = 0
        self._framer: Framer | None = None
        self._socket_body: SocketBody | None = None
        self._direct = False  # the engine thread writes this stream's events (under _lock)
        self._lock = threading.Lock()
        self._loop = asyncio.get_running_loop()
        engine.submit(job, self._emit, backlog=lambda: self._emitted - self._taken)

    def write_directly(self, framer: Framer, socket_body: SocketBody | None) -> None:
        """Let the engine thread write this stream's events with `framer` whenever the reader of `events()` is
        waiting with everything before sent (call before reading it). The reader must frame with the same
        function, send each event's bytes before it asks for the next event, and not read ahead (`frames`
        does all of that; this is for a reader that merges several streams)."""
        self._framer, self._socket_body = framer, socket_body

    async def frames(self, framer: Framer, socket_body: SocketBody | None) -> AsyncIterator[bytes]:
        """The events' bytes as `framer` gives them, each asked for once the last is sent, the engine thread
        writing them itself where it may."""
        self.write_directly(framer, socket_body)
        async for event in self.events():
            if data := framer(event):
                yield data

    def _emit(self, event: Event) -> None:  # runs on the engine thread
        item: Event | bytes = event
        with self._lock:
            if self._direct and not event.terminal:
                rest = self._write(event)
                if rest is None:
                    return
                self._direct = False  # the socket is full or gone: the loop writes from here on
                item = rest
            self._emitted += 1
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _write(self, event: Event) -> bytes | Event | None:
        """The event written to the socket (None), what of it the socket did not take, or the event itself
        when framing it failed (the loop frames it again and fails there, as it would have)."""
        assert self._framer is not None and self._socket_body is not None
        try:
            data = self._framer(event)
        except Exception:
            return event
        return self._socket_body.write(data) if data else None

    async def events(self) -> AsyncIterator[Event]:
        """Every event up to and including the terminal one (those the engine thread wrote itself excepted).

        Its handler has sent everything it was given each time this asks for more, so that is when
        the engine thread may take over the writing."""
        terminal_seen = False
        try:
            while not terminal_seen:
                if self._emitted == self._taken:
                    self._go_direct()
                item = await self._queue.get()
                self._taken += 1
                if isinstance(item, bytes):  # what the socket did not take of an event the engine wrote
                    if self._socket_body is not None:
                        self._socket_body.write_rest(item)
                    continue
                terminal_seen = item.terminal
                yield item
        finally:
            with self._lock:
                self._direct = False
            if self._socket_body is not None:
                self._socket_body.close()
            if not terminal_seen:  # the client went away: free the job's resources
                self.engine.cancel(self.job_id)
                log.info("client disconnected; job cancelled", extra={"job_id": self.job_id})

    def _go_direct(self) -> None:
        if self._socket_body is None or self._framer is None:
            return
        with self._lock:
            # Emitted against taken, not the queue's length: an event on its way to the queue (call_soon_threadsafe)
            # is counted as emitted already, and must be sent before anything the engine writes.
            if not self._direct and self._emitted == self._taken and self._socket_body.open():
                self._direct = True
