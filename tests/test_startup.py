"""Start-up: the ready callback, and one clear line for every bad start-up input."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Worker, assert_one_line_failure, free_port, run_worker_to_exit, start_worker, stop_worker
from launch import worker_command

pytestmark = pytest.mark.cpu


class CallbackServer:
    """A local pool-manager stand-in that records callbacks and checks the worker answers."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.health_at_callback: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                try:
                    outer.health_at_callback.append(httpx.get(f"{body['uri']}/health", timeout=5).status_code)
                except httpx.HTTPError:
                    outer.health_at_callback.append(-1)
                outer.received.append(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ready"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> CallbackServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def callback_server() -> Iterator[CallbackServer]:
    with CallbackServer() as server:
        yield server


def test_ready_callback_after_the_server_answers(tmp_path: Path, callback_server: CallbackServer) -> None:
    worker = start_worker(tmp_path, "--callback-url", callback_server.url, "--worker-id", "w-7",
                          "--ctx-size", "64", "--max-prompt-tokens", "30")
    try:
        deadline = time.monotonic() + 30
        while not callback_server.received and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(callback_server.received) == 1
        body = callback_server.received[0]
        assert body["worker_id"] == "w-7"
        assert body["uri"] == worker.base_url
        assert body["vram_bytes"] > 0
        assert callback_server.health_at_callback == [200]

        # The same worker, started with --ctx-size 64, refuses a job that cannot fit.
        response = httpx.post(f"{worker.base_url}/execute",
                              json={"job_id": "big", "prompt": "word " * 20, "max_tokens": 50})
        assert response.status_code == 400
        error = response.json()["errors"][0]
        assert error["field"] == "max_tokens"
        assert "context size of 64" in error["message"]
        # ... and, started with --max-prompt-tokens 30, a prompt longer than that, naming the prompt.
        response = httpx.post(f"{worker.base_url}/execute",
                              json={"job_id": "long", "prompt": "word " * 35, "max_tokens": 1})
        assert response.status_code == 400
        assert response.json()["errors"][0]["field"] == "prompt"
    finally:
        stop_worker(worker)


def test_refused_callback_means_a_nonzero_exit_after_bounded_retries() -> None:
    closed_port = free_port()
    started = time.monotonic()
    result = run_worker_to_exit("--callback-url", f"http://127.0.0.1:{closed_port}/ready", "--callback-timeout", "2")
    assert result.returncode != 0
    assert "ready callback never succeeded" in result.stderr
    assert result.stderr.count("ready callback failed") >= 2  # it retried
    assert time.monotonic() - started < 120


def write_gguf(path: Path, architecture: str) -> None:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_missing_model_file(tmp_path: Path, callback_server: CallbackServer) -> None:
    missing = tmp_path / "nope.gguf"
    result = run_worker_to_exit("--model", str(missing), "--callback-url", callback_server.url)
    assert_one_line_failure(result, str(missing), "no such file")
    assert callback_server.received == []  # never announce a worker that failed


def test_truncated_gguf(tmp_path: Path, model_path: Path) -> None:
    truncated = tmp_path / "half.gguf"
    truncated.write_bytes(model_path.read_bytes()[: 120_000_000])
    result = run_worker_to_exit("--model", str(truncated))
    assert_one_line_failure(result, str(truncated), "truncated")


def test_corrupt_gguf(tmp_path: Path) -> None:
    corrupt = tmp_path / "noise.gguf"
    corrupt.write_bytes(bytes(range(256)) * 64)
    result = run_worker_to_exit("--model", str(corrupt))
    assert_one_line_failure(result, str(corrupt), "not a GGUF file")


def test_unknown_architecture(tmp_path: Path) -> None:
    odd = tmp_path / "odd.gguf"
    write_gguf(odd, "mamba9")
    result = run_worker_to_exit("--model", str(odd))
    assert_one_line_failure(result, str(odd), "unknown architecture 'mamba9'")


def test_pickle_checkpoints_are_refused(tmp_path: Path) -> None:
    pickled = tmp_path / "pytorch_model.bin"
    pickled.write_bytes(b"\x80\x04not really")
    result = run_worker_to_exit("--model", str(pickled))
    assert_one_line_failure(result, str(pickled), "pickle")


def test_context_size_beyond_the_model(tmp_path: Path) -> None:
    result = run_worker_to_exit("--ctx-size", "999999")
    assert_one_line_failure(result, "--ctx-size 999999")


def test_kv_cache_budgets_that_cannot_hold_two_blocks_are_refused() -> None:
    result = run_worker_to_exit("--kv-cache-mb", "0")
    assert result.returncode == 2 and "--kv-cache-mb: must be at least 1, got 0" in result.stderr
    # One 16-token block of the default model in float32 (torch's path: the C step keeps float16) is
    # 0.56 MB: 1 MB holds only one.
    result = run_worker_to_exit("--kv-cache-mb", "1", "--dtype", "f32", "--dequantize")
    assert_one_line_failure(result, "--kv-cache-mb 1 is smaller than two KV blocks of this model")


# The program's own path (programs.py -> workers.run_worker), stopped where it would begin serving.
SERVE_AND_REPORT = """
import asyncio, gc, sys
import llorch.workers as workers

async def serve(self, app):
    if self.loading is not None:
        await asyncio.to_thread(self.loading.wait)
    print("collecting", gc.isenabled(), "frozen", gc.get_freeze_count())
    return 0

workers.Lifecycle.run = serve
sys.argv = ["llorch-cpu-worker", "--port", "0", "--log-level", "warning"]
from llorch.programs import cpu_main
cpu_main()
"""


def test_the_worker_program_serves_with_the_collector_on() -> None:
    """The program pauses Python's collector while it imports and loads (collector.py); by the time it
    serves, collection runs again, or every reference cycle a request leaves would stay for the process's
    life. What the start made is frozen: later collections do not scan it again."""
    result = subprocess.run([sys.executable, "-c", SERVE_AND_REPORT],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:2] == ["collecting", "True"], result.stdout
    assert int(words[3]) > 10_000, result.stdout


def test_metrics_give_the_process_figures(worker: Worker) -> None:
    metrics = {sample.name: sample.value for family in text_string_to_metric_families(
        httpx.get(f"{worker.base_url}/metrics").text) for sample in family.samples}
    assert metrics["process_resident_memory_bytes"] > 100e6  # the weights and the libraries
    assert metrics["process_cpu_seconds_total"] > 0
    assert "python_gc_collections_total" in metrics


@pytest.mark.parametrize("program", ["llorch-cpu-worker", "llorch-cuda-worker", "llorch-accelerate-worker"])
def test_help_lists_the_flags(program: str) -> None:
    """`--help` printed nothing but a traceback while one flag's help held a bare percent sign."""
    result = subprocess.run([*worker_command(program), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--kv-cache-mb" in result.stdout and "50% of the GPU" in result.stdout
    assert "--grammar-at-start" in result.stdout
