"""Event framing: Server-Sent Events (both APIs) or JSON lines (the worker API on request)."""

from __future__ import annotations

import json
from typing import Any

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


def negotiate(accept: str | None) -> str:
    """NDJSON when the client's Accept asks for it, SSE otherwise."""
    return NDJSON if accept and NDJSON in accept.lower() else SSE


def _json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event: an optional `event:` name and the JSON payload as its data."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {_json(payload)}\n\n".encode()


def frame(media_type: str, event: dict[str, Any]) -> bytes:
    """A worker API event in the negotiated framing (SSE events are named after their type)."""
    if media_type == NDJSON:
        return f"{_json(event)}\n".encode()
    return sse(event, event["type"])
