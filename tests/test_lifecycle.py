"""The worker's lifecycle as a process: loading, draining on SIGTERM, and a bounded soak."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Worker, start_worker, stop_worker
from launch import wait_ready, worker_command
from soak import soak

pytestmark = pytest.mark.cpu

LONG_RUNNING = {"prompt": "List the numbers from 1 to 500: 1, 2, 3,", "temperature": 0, "max_tokens": 2048}


def spawn(tmp: Path, *extra: str) -> Worker:
    """A worker process, returned at once (not waiting for it to be healthy)."""
    return start_worker(tmp, *extra, wait=False)


def test_health_says_loading_with_progress_until_healthy(tmp_path: Path, model_path: Path) -> None:
    # A copy the cache has no digest for loads once the server accepts (a warm start of a file the cache
    # knows may load before the server binds, with nothing to see).
    copy = shutil.copyfile(model_path, tmp_path / "copy.gguf")
    worker = spawn(tmp_path, "--max-connections", "2", "--model", str(copy))
    try:
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and worker.process.poll() is None:
            body = worker.health()
            if body is not None:
                seen.append(body)
                if body["status"] == "healthy":
                    break
            time.sleep(0.05)
        statuses = [b["status"] for b in seen]
        assert statuses and statuses[-1] == "healthy", worker.log()
        assert "loading" in statuses  # the server answers while the weights load
        progress = [b["progress"] for b in seen if b["status"] == "loading"]
        assert progress == sorted(progress)
        assert all(0 <= p <= 1 for p in progress)

        # The same worker answers 2 requests at once: with two streams open, a third request is
        # refused in its API's shape, while /health still answers.
        # Long enough to still run when the third request comes, short enough to end on their own.
        held = {**LONG_RUNNING, "max_tokens": 48}
        streams = [Reader(worker.base_url, {"job_id": f"hold-{i}", **held}) for i in range(2)]
        for reader in streams:
            reader.start()
            assert reader.first_token.wait(60), "a stream within the request limit was refused"
        assert httpx.get(f"{worker.base_url}/health").status_code == 200
        busy = httpx.post(f"{worker.base_url}/cancel", json={"job_id": "hold-0"})
        assert busy.status_code == 503 and "--max-connections" in busy.json()["errors"][0]["message"]
        busy = httpx.get(f"{worker.base_url}/v1/models")
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
        for reader in streams:
            reader.join(60)
            assert reader.events[-1].get("stop_reason") == "MAX_TOKENS", reader.events[-2:]
    finally:
        stop_worker(worker)


class Reader(threading.Thread):
    """Reads one job's stream to its end, in the background."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[dict[str, Any]] = []
        self.first_token = threading.Event()
        self.transport_error: httpx.HTTPError | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/execute", json=self.body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        if self.events[-1]["type"] == "token":
                            self.first_token.set()
        except httpx.HTTPError as exc:  # a stream cut without a terminal event: the tests check for that
            self.transport_error = exc


def test_a_taken_port_fails_with_one_line_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([*worker_command(), "--port", str(port), "--log-level", "critical"],
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip() == f"llorch-cpu-worker: error: could not serve on 127.0.0.1:{port}"


def test_sigterm_drains_every_stream_to_a_terminal_event_and_exits_0(tmp_path: Path) -> None:
    worker = spawn(tmp_path, "--drain-timeout", "6")
    try:
        wait_ready(worker)
        long_jobs = [Reader(worker.base_url, {"job_id": f"long-{i}", **LONG_RUNNING}) for i in range(2)]
        for reader in long_jobs:
            reader.start()
        for reader in long_jobs:
            assert reader.first_token.wait(60)
        short_job = Reader(worker.base_url, {"job_id": "short", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        short_job.start()
        assert short_job.first_token.wait(60)
        # A non-streaming OpenAI request cut by the drain is a 503 (retry elsewhere), not a 500.
        model = httpx.get(f"{worker.base_url}/v1/models").json()["data"][0]["id"]
        unary: list[httpx.Response] = []
        unary_body = {"model": model, "prompt": LONG_RUNNING["prompt"], "max_tokens": 2048, "temperature": 0}
        unary_thread = threading.Thread(target=lambda: unary.append(
            httpx.post(f"{worker.base_url}/v1/completions", json=unary_body, timeout=60)))
        unary_thread.start()
        time.sleep(0.5)
        signalled = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert (worker.health() or {}).get("status") == "draining"
        refused = httpx.post(f"{worker.base_url}/execute", json={"job_id": "late", "prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503
        assert worker.process.wait(30) == 0
        assert time.monotonic() - signalled < 6 + 10
        for reader in [*long_jobs, short_job]:
            reader.join(10)
            terminals = [e for e in reader.events if e["type"] in ("end", "error")]
            assert len(terminals) == 1, reader.events[-3:]
            assert reader.events[-1] is terminals[0]
        assert short_job.events[-1]["type"] == "end"  # it finished within the drain time
        for reader in long_jobs:
            assert reader.events[-1] == {"type": "error", "code": "CANCELLED",
                                         "message": "the worker is shutting down"}
        unary_thread.join(10)
        assert unary[0].status_code == 503 and unary[0].json()["error"]["code"] == "cancelled", unary[0].text
        assert unary[0].headers["retry-after"] == "1"
    finally:
        stop_worker(worker)


def test_short_soak_every_job_ends_once_and_nothing_leaks(worker: Worker) -> None:
    report = soak(worker.base_url, worker.process.pid, clients=3, seconds=15,
                  enough=lambda report: report.accepted > 5, longest=90)  # a loaded machine serves fewer a second
    assert report.accepted > 5
    assert report.server_errors_5xx == 0
    assert report.exactly_one_terminal == report.completed + report.cancelled
    assert report.accepted_by_worker >= report.accepted  # abandoned non-streaming jobs come on top
    assert report.ended_by_worker == report.accepted_by_worker  # disconnected and abandoned jobs ended too
    assert report.in_flight_after == 0
    assert report.kv_bytes_after == 0
    assert not report.problems and report.ok
