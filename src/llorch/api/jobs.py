"""Bridge from the engine thread to an HTTP handler: submit a prepared job, await its events.

Both APIs (worker and OpenAI) submit through here, so there is one generation path.
A stream that is abandoned before its terminal event cancels its job; one whose reader falls
behind holds its job until it catches up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from llorch.engine.engine import Engine
from llorch.engine.request import Event, PreparedJob

log = logging.getLogger("llorch.api")


class JobStream:
    def __init__(self, engine: Engine, job: PreparedJob) -> None:
        """Submit the job now (raises the engine's refusals); its events are read with `events()`."""
        self.engine = engine
        self.job_id = job.request.job_id
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        # Events emitted and taken, each counted by one thread only: their difference is what the reader
        # has left untaken, which holds the job (Engine.submit) when the client stops reading.
        self._emitted = self._taken = 0
        loop = asyncio.get_running_loop()

        def emit(event: Event) -> None:  # runs on the engine thread
            self._emitted += 1
            loop.call_soon_threadsafe(self._queue.put_nowait, event)

        engine.submit(job, emit, backlog=lambda: self._emitted - self._taken)

    async def events(self) -> AsyncIterator[Event]:
        """Every event up to and including the terminal one."""
        terminal_seen = False
        try:
            while not terminal_seen:
                event = await self._queue.get()
                self._taken += 1
                terminal_seen = event.terminal
                yield event
        finally:
            if not terminal_seen:  # the client went away: free the job's resources
                self.engine.cancel(self.job_id)
                log.info("client disconnected; job cancelled", extra={"job_id": self.job_id})
