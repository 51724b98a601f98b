"""Event framing for the worker API: Server-Sent Events or JSON lines."""

from __future__ import annotations

import json
from typing import Any

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


def negotiate(accept: str | None) -> str:
    """NDJSON when the client's Accept asks for it, SSE otherwise."""
    return NDJSON if accept and NDJSON in accept.lower() else SSE


def frame(media_type: str, event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    if media_type == NDJSON:
        return f"{data}\n".encode()
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
