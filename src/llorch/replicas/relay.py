"""An HTTP request carried from the front to a replica, and answered there by the worker's own app.

The replica runs the request through the same ASGI app a single worker serves (routes, validation,
auth, streaming, errors), so the cluster's HTTP surface is the worker's by construction. What comes
back is a `RelayedStart` (status and headers) and then the body in chunks, as they are produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

log = logging.getLogger("llorch.replicas")

ROUTING_TEXT_CHARS = 8192  # the router reads no more of a prompt than this
APP_EXIT_GRACE_S = 5.0  # after the front goes away, how long the app may take to cancel its jobs


@dataclass(frozen=True)
class RelayedRequest:
    method: str
    path: str
    query: bytes
    headers: tuple[tuple[str, str], ...]
    body: bytes
    client: tuple[str, int] | None = None
    routing_text: str = ""  # what prefix affinity keys on ("" = no preference)
    pin: str | None = None  # this replica only (the one holding a job, or the one asked about)
    avoid: tuple[str, ...] = field(default=())  # replicas that answered busy for this request


@dataclass(frozen=True)
class RelayedStart:
    status: int
    headers: tuple[tuple[str, str], ...]
    replica: str

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


def lenient_json(body: bytes) -> Any:
    """The body as JSON, or None. Lenient on purpose: a body the worker will refuse is still
    relayed, and refused there in the worker's own words."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


# Routes whose body names what the model reads first: a prompt, or chat messages.
PROMPT_ROUTES = frozenset({"/execute", "/completions", "/chat/completions", "/completion"})


def routing_text(path: str, request: Any) -> str:
    """The start of what the model will read for this request, or "" when it reads no prompt."""
    route = path.removeprefix("/v1")  # the OpenAI routes answer at the root too
    if route not in PROMPT_ROUTES or not isinstance(request, dict):
        return ""
    if route == "/chat/completions":
        parts = [json.dumps(request.get("tools"), sort_keys=True)] if request.get("tools") else []
        for message in request.get("messages") or []:
            if isinstance(message, dict):
                parts.append(f"{message.get('role')}\x00{_text_of(message.get('content'))}\x00")
        text = "".join(parts)
    else:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and prompt:  # a batch of prompts (or token ids): keyed on the first
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt) if isinstance(prompt, list) else ""
    return text[:ROUTING_TEXT_CHARS]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


async def answer_in_process(app: ASGIApp, request: RelayedRequest, replica: str
                            ) -> AsyncIterator[RelayedStart | bytes]:
    """Run `request` through `app` here; yield its start, then its body as it comes.

    Chunks produced while the previous one was in transit go together in one. When the caller
    stops reading (the front went away), the app is told the client disconnected, which cancels
    the request's jobs exactly as a dropped connection to a single worker does."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "query_string": request.query, "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": request.client, "server": ("replica", 0), "state": {},
    }
    disconnected = asyncio.Event()
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    outbox: asyncio.Queue[Message | None] = asyncio.Queue()

    async def send(message: Message) -> None:
        await outbox.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except Exception:
            log.exception("the app failed on a relayed request", extra={"path": request.path})
        finally:
            await outbox.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await outbox.get()
            if message is None:
                return
            if message["type"] == "http.response.start":
                headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", []))
                yield RelayedStart(message["status"], headers, replica)
                continue
            chunks, ended = [message.get("body", b"")], not message.get("more_body", False)
            while not ended and not outbox.empty():  # coalesce what is already waiting
                queued = outbox.get_nowait()
                if queued is None or queued["type"] != "http.response.body":
                    outbox.put_nowait(queued)  # type: ignore[arg-type]
                    break
                chunks.append(queued.get("body", b""))
                ended = not queued.get("more_body", False)
            data = b"".join(chunks)
            if data:
                yield data
            if ended:
                return
    finally:
        if not task.done():
            disconnected.set()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), APP_EXIT_GRACE_S)
            task.cancel()
