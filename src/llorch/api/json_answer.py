"""Non-streamed JSON answers, built and encoded on a worker thread, not on the event loop.

A long answer with log-probabilities (2048 tokens with 20 alternatives each) is megabytes
of JSON: building and encoding it on the event loop would stall every stream, /health
and every other request for tens of milliseconds. The bytes are those JSONResponse
would send.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Response
from starlette.concurrency import run_in_threadpool


def encode(body: Any) -> bytes:
    """JSON as JSONResponse renders it: compact, UTF-8, no NaN or infinity."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


async def json_answer(build: Callable[[], Any], status_code: int = 200, small: bool = False) -> Response:
    """The answer `build()` returns, built and encoded off the event loop (its jobs have ended: nothing it
    reads changes meanwhile); a `small` one on the loop, where the trip to a thread would cost more."""
    content = encode(build()) if small else await run_in_threadpool(lambda: encode(build()))
    return Response(content, status_code, media_type="application/json")
