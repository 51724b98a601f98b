"""Chat templates render in a helper process, bounded in time, memory and output.

jinja2's sandbox stops attribute games, but a template is still a program: nested
`range(100000)` loops run for hours and `'x' * 400000000` takes gigabytes. A thread
cannot be stopped and memory cannot be limited per thread, so templates render in one
long-lived child process (`python -m llorch.weights.template_sandbox`, which imports
jinja2 and nothing heavy). The child's address space is capped; a render that takes
longer than RENDER_TIMEOUT_S kills it, and the next render starts a fresh one. Each
breach is a ChatTemplateError naming the limit, which the API turns into a 400.

The protocol is one JSON line each way: a request carries the template's digest, its
source the first time this child sees it, and the render arguments; the answer holds
the text or an error message.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the child imports jinja2; the worker itself never renders (~20 ms of its start-up)
    from jinja2 import Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIMEOUT_S = 2.0  # real templates render in milliseconds, even for long conversations
MAX_RENDERED_CHARS = 4 << 20  # far beyond any context window's worth of text
SANDBOX_MEMORY_BYTES = 1 << 30  # the child's whole address space
START_TIMEOUT_S = 30.0  # a cold interpreter importing jinja2 on a loaded machine


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, is broken, or broke a limit)."""


class TemplateSandbox:
    """The parent's handle on the render process; thread-safe, one render at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._ready = False  # the current child has said it is ready
        self._known: set[str] = set()  # digests of the templates the current child has compiled

    def start(self) -> None:
        """Start the render process without waiting for it: it imports jinja2 while the model loads."""
        with self._lock:
            self._spawn()

    def compile(self, source: str) -> str:
        """Compile `source` in the child (raising its syntax errors); returns the template's digest."""
        digest = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
        self._call(digest, source, None)
        return digest

    def render(self, digest: str, source: str, arguments: dict[str, Any]) -> str:
        return self._call(digest, source, arguments)

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _call(self, digest: str, source: str, arguments: dict[str, Any] | None) -> str:
        with self._lock:
            process = self._ensure_started()
            request: dict[str, Any] = {"digest": digest, "arguments": arguments}
            if digest not in self._known:
                request["source"] = source
            try:
                line = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass")
            except (TypeError, ValueError) as exc:
                raise ChatTemplateError(f"the messages cannot be passed to the chat template ({exc})") from exc
            assert process.stdin is not None
            try:
                process.stdin.write(line + b"\n")
                process.stdin.flush()
            except OSError as exc:
                self._stop()
                raise ChatTemplateError("the chat template process died; it restarts on the next request") from exc
            # A child that has not seen the template compiles it first: a limit it breaks may be either's.
            action = "compile" if arguments is None else "compile and render" if "source" in request else "render"
            answer = self._read_answer(process, action)
            if answer.get("compiled"):
                self._known.add(digest)
            if "error" in answer:
                raise ChatTemplateError(answer["error"])
            return str(answer["text"])

    def _read_answer(self, process: subprocess.Popen[bytes], action: str) -> dict[str, Any]:
        assert process.stdout is not None
        deadline = time.monotonic() + RENDER_TIMEOUT_S
        chunks = bytearray()
        while not chunks.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([process.stdout], [], [], max(left, 0))
            if not ready:
                self._stop()
                raise ChatTemplateError(f"the chat template took longer than {RENDER_TIMEOUT_S:g} s to {action}; "
                                        "it was stopped")
            chunk = os.read(process.stdout.fileno(), 1 << 20)
            if not chunk:  # the child died: out of memory, or worse
                self._stop()
                raise ChatTemplateError(f"the chat template needed more than {SANDBOX_MEMORY_BYTES >> 20} MiB "
                                        f"to {action}; it was stopped")
            chunks += chunk
        return json.loads(chunks.decode("utf-8", "surrogatepass"))

    def _spawn(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            self._known.clear()
            self._ready = False
            self._process = subprocess.Popen(
                [sys.executable, "-m", "llorch.weights.template_sandbox"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, close_fds=True)
        return self._process

    def _ensure_started(self) -> subprocess.Popen[bytes]:
        process = self._spawn()
        if not self._ready:
            assert process.stdout is not None
            # The child says it is ready once jinja2 is imported: start-up is not render time.
            ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
            if not ready or process.stdout.readline() != b"ready\n":
                self._stop()
                raise ChatTemplateError("the chat template process did not start")
            self._ready = True
        return process

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for stream in (self._process.stdin, self._process.stdout):
                if stream is not None:
                    stream.close()
            self._process = None
        self._known.clear()


# One render process per worker process, started on first use.
_sandbox: TemplateSandbox | None = None
_sandbox_lock = threading.Lock()


def shared_sandbox() -> TemplateSandbox:
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = TemplateSandbox()
        return _sandbox


# -- the child --------------------------------------------------------------------------------------

def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _render(template: Template, arguments: dict[str, Any]) -> str:
    """The whole text, refused as soon as it grows past MAX_RENDERED_CHARS."""
    size, parts = 0, []
    for part in template.generate(**arguments):
        size += len(part)
        if size > MAX_RENDERED_CHARS:
            raise ChatTemplateError(f"the chat template rendered more than {MAX_RENDERED_CHARS} characters; "
                                    "it was stopped")
        parts.append(part)
    return "".join(parts)


def _answer(request: dict[str, Any], env: ImmutableSandboxedEnvironment, compiled: dict[str, Template]
            ) -> dict[str, Any]:
    """The render's text or error, and whether this child now holds the template (the parent then
    stops sending its source)."""
    answer = _render_or_error(request, env, compiled)
    return {**answer, "compiled": request["digest"] in compiled}


def _render_or_error(request: dict[str, Any], env: ImmutableSandboxedEnvironment, compiled: dict[str, Template]
                     ) -> dict[str, Any]:
    from jinja2 import TemplateError

    digest = request["digest"]
    if digest not in compiled:
        error = _compile(request["source"], env, compiled, digest)
        if error:
            return {"error": error}
    try:
        if request["arguments"] is None:
            return {"text": ""}
        return {"text": _render(compiled[digest], request["arguments"])}
    except ChatTemplateError as exc:
        return {"error": str(exc)}
    except TemplateError as exc:
        return {"error": f"the chat template failed: {exc}"}
    except MemoryError:
        return {"error": f"the chat template needed more than {SANDBOX_MEMORY_BYTES >> 20} MiB to render"}
    except RecursionError:
        return {"error": "the chat template recursed too deeply"}
    except Exception as exc:  # whatever else a template can provoke (range too big, no loader, ...)
        return {"error": f"the chat template failed: {type(exc).__name__}: {exc}"}


def _compile(source: str, env: ImmutableSandboxedEnvironment, compiled: dict[str, Template], digest: str
             ) -> str | None:
    """Compile `source` into `compiled`; the error message when it cannot be.

    Compiling runs template code too: jinja2 folds constant expressions, so `'x' * 10**9`
    is computed here, before any render.
    """
    from jinja2 import TemplateError

    try:
        compiled[digest] = env.from_string(source)
    except TemplateError as exc:
        return f"the chat template does not compile: {exc}"
    except MemoryError:
        return f"the chat template needed more than {SANDBOX_MEMORY_BYTES >> 20} MiB to compile"
    except RecursionError:
        return "the chat template nests too deeply to compile"
    except Exception as exc:  # whatever else constant folding can provoke
        return f"the chat template does not compile: {type(exc).__name__}: {exc}"
    return None


def serve() -> None:
    """Answer render requests on stdin/stdout until stdin closes (the worker exited)."""
    resource.setrlimit(resource.RLIMIT_AS, (SANDBOX_MEMORY_BYTES, SANDBOX_MEMORY_BYTES))
    env, compiled = _environment(), {}
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        answer = _answer(json.loads(line.decode("utf-8", "surrogatepass")), env, compiled)
        try:
            data = json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogatepass")
        except MemoryError:
            data = json.dumps({"error": "the chat template's output does not fit in memory"}).encode()
        out.write(data + b"\n")
        out.flush()


if __name__ == "__main__":
    serve()
