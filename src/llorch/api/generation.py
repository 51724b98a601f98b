"""What every API that generates shares: preparing jobs, tool-call constraints, merging the events
of several jobs, and noticing a client that goes away before a whole answer is ready.

The API modules (OpenAI, Anthropic Messages, OpenAI Responses, Ollama) differ only in
the shapes they read and write; each builds GenerationRequests, submits them through
JobStream and frames the events it reads back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from llorch.api.jobs import JobStream
from llorch.api.tool_calls import ToolFormat, format_for
from llorch.api.tool_calls import grammar as tool_grammar
from llorch.engine.engine import Engine
from llorch.engine.errors import RequestRejected
from llorch.engine.request import Constraint, Event, GenerationRequest, PreparedJob

CLIENT_CLOSED_REQUEST = 499  # logged only: the client is gone
log = logging.getLogger("llorch.api")


def tool_constraint(engine: Engine, tools: list[dict[str, Any]], mode: str, parallel: bool
                    ) -> tuple[ToolFormat, Constraint]:
    """The template's tool-call format and the grammar that keeps the model's turn to it."""
    template = engine.chat_template
    fmt = format_for(template.source if template else None, bool(template and template.reads_tools))
    marker_id = engine.tokens.token_id(fmt.marker) if fmt.marker else None
    special = {fmt.marker: marker_id} if marker_id is not None and marker_id in engine.tokens.special_ids else {}
    return fmt, Constraint("lark", tool_grammar(fmt, tools, mode, parallel, special), "tools")


def prepare_all(engine: Engine, requests: list[GenerationRequest]) -> list[PreparedJob]:
    """Each prompt through the front door; a refusal of one of several names its index."""
    prepared = []
    for index, request in enumerate(requests):
        try:
            prepared.append(engine.prepare(request))
        except RequestRejected as exc:
            if len(requests) > 1 and exc.field in ("prompt", "input", "documents"):
                raise RequestRejected(f"{exc.field}.{index}", exc.constraint, f"{exc.field} {index}: {exc.message}",
                                      exc.code) from exc
            raise
    return prepared



async def unless_disconnected(http: Request, work: asyncio.Future[None]) -> bool:
    """Await `work`, unless the client goes away first: then cancel it (ending its jobs) and say False.

    A streaming response notices a gone client when a write fails; a request that answers
    once at the end writes nothing until then, so it listens for the server's disconnect
    message meanwhile (its body is read: nothing else can arrive).
    """

    async def client_gone() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_gone())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work in done:
        work.result()  # its error, if it failed
        return True
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    log.info("client disconnected before its answer; jobs cancelled")
    return False



async def merged(streams: list[JobStream]) -> AsyncIterator[tuple[int, Event]]:
    """Events of all choices as they come, tagged with the choice index."""
    if len(streams) == 1:
        async for event in streams[0].events():
            yield 0, event
        return
    # Bounded, so a reader that stops taking events stops the pumps too, and with them the jobs (jobs.py).
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: JobStream) -> None:
        async for event in stream.events():
            await queue.put((index, event))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, event = await queue.get()
            if event is None:
                remaining -= 1
            else:
                yield index, event
    finally:
        for task in tasks:  # cancelling a pump cancels its job
            task.cancel()


