"""Start and stop server processes on loopback: the one launcher the tests and the benchmarks share.

`start_server` runs any command and waits until its /health answers as `ready` says;
`start_worker` does that for a llorch worker program on a free port.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path | None = None
    start_to_ready_s: float = 0.0

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120, **kwargs)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def health(self) -> dict[str, object] | None:
        """The /health body, or None while it cannot answer (not bound yet, or at its connection limit)."""
        try:
            response = httpx.get(f"{self.base_url}/health", timeout=1)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None


def healthy(response: httpx.Response) -> bool:
    """A llorch worker is ready when /health says healthy (it answers `loading` before)."""
    return response.status_code == 200 and response.json().get("status") == "healthy"


def llama_healthy(response: httpx.Response) -> bool:
    """llama-server is ready when /health answers 200 (503 while it loads)."""
    return response.status_code == 200


def wait_ready(server: Server, ready: Callable[[httpx.Response], bool] = healthy,
               timeout: float = START_TIMEOUT_S) -> None:
    began = time.perf_counter()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.process.args!r} exited with {server.process.returncode}:\n{server.log()}")
        try:
            if ready(httpx.get(f"{server.base_url}/health", timeout=1)):
                server.start_to_ready_s += time.perf_counter() - began
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    stop(server)
    raise RuntimeError(f"{server.process.args!r} did not become ready in {timeout:g} s:\n{server.log()}")


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the process that started it dies, so a run
    that is interrupted, even by SIGKILL, leaves no server behind. Servers are started from the
    main thread, whose exit is what this watches."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(command: list[str], base_url: str, ready: Callable[[httpx.Response], bool] = healthy,
                 log_path: Path | None = None, wait: bool = True, env: dict[str, str] | None = None) -> Server:
    """Run `command` (its output to `log_path`, or discarded) and, with `wait`, wait until it is ready."""
    began = time.perf_counter()
    out = log_path.open("wb") if log_path else subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                               preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    server = Server(process, base_url, log_path)
    server.start_to_ready_s = time.perf_counter() - began
    if wait:
        wait_ready(server, ready)
    return server


def worker_command(program: str = "llorch-cpu-worker") -> list[str]:
    """The installed program, or (in a checkout used through PYTHONPATH) its entry point."""
    script = Path(sys.executable).parent / program
    if script.exists():
        return [str(script)]
    backend = program.removeprefix("llorch-").removesuffix("-worker")
    entry = f"import sys; from llorch.workers import run_worker; sys.exit(run_worker({backend!r}))"
    return [sys.executable, "-c", entry]


def start_worker(log_dir: Path | None, *flags: str, program: str = "llorch-cpu-worker", wait: bool = True) -> Server:
    """A llorch worker on a free loopback port, logging text lines to a file in `log_dir`."""
    port = free_port()
    log_path = log_dir / f"worker-{port}.log" if log_dir else None
    command = [*worker_command(program), "--port", str(port), "--log-format", "text", *flags]
    return start_server(command, f"http://127.0.0.1:{port}", log_path=log_path, wait=wait)


def stop(server: Server, timeout: float = 15) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
