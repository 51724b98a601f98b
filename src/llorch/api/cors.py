"""CORS: which web pages may call the worker from a browser.

By default, pages served from localhost or 127.0.0.1 (http or https, any port) may, as a
local model server's users expect (a notebook, a chat front-end on another port); any
other origin needs `--cors-origins`. `*` allows every origin and is only used when asked
for. Preflights are answered before the API key is checked (browsers send no credentials
with them); the requests that follow still need the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?"
PREFLIGHT_MAX_AGE_S = 600


def parse_origins(value: str | None) -> list[str] | None:
    """`--cors-origins`: None (the local default), "none" (no cross-origin calls), "*", or a comma-separated list."""
    if value is None:
        return None
    origins = [origin.strip().rstrip("/") for origin in value.split(",") if origin.strip()]
    if origins == ["none"]:
        return []
    for origin in origins:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise ValueError(f"a CORS origin is '*' or starts with http:// or https://, not {origin!r}")
    return origins


def install_cors(app: FastAPI, origins: list[str] | None) -> None:
    """Added last, so it wraps everything else: preflights never reach auth, and every answer, errors included,
    carries the headers a browser needs to read it."""
    if origins == []:
        return
    from starlette.middleware.cors import CORSMiddleware  # here: the worker parses its flags before the web stack

    app.add_middleware(
        CORSMiddleware,
        allow_origins=origins or [],
        allow_origin_regex=None if origins else LOCAL_ORIGINS,
        allow_methods=["GET", "POST", "DELETE", "HEAD", "OPTIONS"],
        allow_headers=["*"],
        expose_headers=["X-Correlation-ID", "Retry-After"],
        max_age=PREFLIGHT_MAX_AGE_S,
    )
