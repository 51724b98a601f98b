"""The chat page at `/`, served by the worker itself: one static file, nothing from a CDN.

The page talks to this worker's own OpenAI API on the same origin. Its Content-Security-Policy
names only 'self' and the hashes of the page's own inline script and style, so the browser
refuses anything from another host even if some text on the page asked for it.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib.resources import files

from fastapi import APIRouter, Response
from fastapi.responses import HTMLResponse

PAGE_FILE = "chat.html"
_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)
_HTML_RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"description": "The chat page", "content": {"text/html": {"schema": {"type": "string"}}}}}


def page_html() -> str:
    return files("llorch.api").joinpath("static", PAGE_FILE).read_text(encoding="utf-8")


def content_security_policy(html: str) -> str:
    """Same origin only; inline code runs only when it is exactly the page's own (hash-pinned)."""
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for tag, body in _INLINE.findall(html):
        digest = base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode("ascii")
        hashes[tag].append(f"'sha256-{digest}'")
    script, style = (" ".join(hashes[tag]) or "'self'" for tag in ("script", "style"))
    return "; ".join([
        "default-src 'self'", f"script-src {script}", f"style-src {style}", "img-src 'self'", "connect-src 'self'",
        "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"])


def create_page_router() -> APIRouter:
    router = APIRouter()
    html = page_html()  # read once: the file ships with the package and does not change while serving
    headers = {"Content-Security-Policy": content_security_policy(html), "Cache-Control": "no-cache",
               "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}

    # HEAD too: Ollama's clients probe the root to see whether a server is up.
    @router.head("/", response_class=HTMLResponse, responses=_HTML_RESPONSES, operation_id="chat_page_head")
    @router.get("/", response_class=HTMLResponse, responses=_HTML_RESPONSES)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)

    # Browsers ask for it on their own; an empty answer keeps their console free of a 404.
    @router.get("/favicon.ico", status_code=204, response_class=Response,
                responses={204: {"description": "No icon"}})
    async def favicon() -> Response:
        return Response(status_code=204)

    return router
