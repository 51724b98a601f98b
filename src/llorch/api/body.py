"""Reading a JSON request body with a size limit, for both APIs."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi import Request

MAX_BODY_BYTES = 1 << 20  # a 32k-character prompt in JSON is far below this
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class _NotPlainJSON(ValueError):
    """A value JSON does not have, though Python's parser takes it."""


def _no_constant(name: str) -> float:
    raise _NotPlainJSON(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotPlainJSON(f"{text[:40]} is out of range for a number")
    return value


def parse_json(body: bytes) -> Any:
    """Strict JSON: no NaN or Infinity, no number that overflows, no unpaired surrogate, bounded nesting
    (Python's parser recurses: a body nested thousands deep would otherwise be a RecursionError)."""
    value = json.loads(body, parse_constant=_no_constant, parse_float=_finite)
    if SURROGATE_ESCAPE.search(body):  # escapes that are not a valid pair decode to lone surrogates
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    return value


class BadRequest(Exception):
    """A body that is too large (413) or not JSON (400), in the worker API's error shape."""

    def __init__(self, status: int, errors: list[dict[str, Any]]) -> None:
        self.status = status
        self.errors = errors


def openapi_json_body(model: type) -> dict[str, Any]:
    """OpenAPI requestBody for a handler that reads its own body with read_json (for clients and fuzzers)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def request_body(model: type) -> dict[str, Any]:
    """OpenAPI requestBody referring to `model`'s schema among the app's components (see openapi_components)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def openapi_components(models: tuple[type, ...]) -> dict[str, Any]:
    """JSON schemas of request bodies (pydantic models) and everything they refer to, for the OpenAPI document."""
    components: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    return components


async def read_json(request: Request) -> Any:
    body = await read_body(request)
    try:
        return parse_json(body)
    except RecursionError as exc:
        raise BadRequest(400, [{"field": "body", "constraint": "valid JSON",
                                "message": "request body is not valid JSON here: it is nested too deeply"}]) from exc
    except (ValueError, UnicodeError) as exc:  # JSONDecodeError, 4300+ digit integers, lone surrogates
        raise BadRequest(400, [{"field": "body", "constraint": "valid JSON",
                                "message": f"request body is not valid JSON: {_why_not_json(exc)}"}]) from exc


def _why_not_json(exc: ValueError | UnicodeError) -> str:
    if isinstance(exc, UnicodeDecodeError):  # bytes that are not text at all (a compressed body, say)
        return f"it is not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x})"
    if isinstance(exc, UnicodeError):  # \ud800 escapes: text no UTF-8 encoder can write back
        return "it has an unpaired surrogate"
    return str(exc)[:200]


def check_not_encoded(request: Request) -> None:
    """A body must come as it is: a compressed one (Content-Encoding) is refused, saying so, not misread."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BadRequest(415, [{"field": "body", "constraint": "no Content-Encoding",
                                "message": f"request bodies with Content-Encoding: {encoding[:40]} are not "
                                           "supported; send the JSON uncompressed"}])


async def read_body(request: Request) -> bytes:
    """The body's bytes, or BadRequest 413 past MAX_BODY_BYTES (declared or sent), or 415 when compressed."""
    check_not_encoded(request)
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
    return body
