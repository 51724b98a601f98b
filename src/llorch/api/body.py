"""Reading a JSON request body with a size limit, for both APIs."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

MAX_BODY_BYTES = 1 << 20  # a 32k-character prompt in JSON is far below this


class BadRequest(Exception):
    """A body that is too large (413) or not JSON (400), in the worker API's error shape."""

    def __init__(self, status: int, errors: list[dict[str, Any]]) -> None:
        self.status = status
        self.errors = errors


async def read_json(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BadRequest(413, [{"field": "body", "constraint": f"<= {MAX_BODY_BYTES} bytes",
                                "message": f"request body of {declared} bytes is too large"}])
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise BadRequest(413, [{"field": "body", "constraint": f"<= {MAX_BODY_BYTES} bytes",
                                    "message": "request body is too large"}])
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(400, [{"field": "body", "constraint": "valid JSON",
                                "message": f"request body is not valid JSON: {exc}"}]) from exc
