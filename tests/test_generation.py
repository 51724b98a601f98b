"""Generation semantics through the in-process engine (and its HTTP app) on the default model.

Failures are injected by wrapping the model runner's public `forward` so that it fails
for one job's segment (recognized by its position, which no other job reaches): the
worker code under test is the real one, with no test hooks in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from conftest import greedy_ids
from jobs import PROMPT, make_engine, run, with_tokenizer
from llorch.api.app import create_app
from llorch.api.state import WorkerState
from llorch.engine.engine import Engine
from llorch.engine.request import GenerationRequest, SamplingParams
from llorch.engine.runner import ChunkInput, ModelRunner
from llorch.weights.loader import LoadedModel

pytestmark = pytest.mark.cpu


@pytest.fixture
def engine(ours: LoadedModel) -> Iterator[Engine]:
    live = make_engine(ours)
    yield live
    live.stop()


def test_stop_sequence_ends_before_its_text(engine: Engine, ours: LoadedModel) -> None:
    full = ours.tokenizer.decode(greedy_ids(ours, ours.tokenizer.encode(PROMPT), 12))
    assert " country" in full  # the greedy continuation: " the capital of the country of France..."
    job = run(engine, "stop-1", stop=("zzz", " country"))
    end = job.wait()
    assert end["stop_reason"] == "STOP_SEQUENCE"
    assert end["stop_sequence_matched"] == " country"
    assert job.text == full[: full.index(" country")]


def fail_at(monkeypatch: pytest.MonkeyPatch, doomed: Callable[[ChunkInput], bool], error: Exception) -> None:
    """Make the runner raise `error` for any step holding a segment for which `doomed` is true."""
    real_forward = ModelRunner.forward

    def forward(self: ModelRunner, segments: list[ChunkInput]) -> Any:
        if any(doomed(segment) for segment in segments):
            raise error
        return real_forward(self, segments)

    monkeypatch.setattr(ModelRunner, "forward", forward)


def prompt_length(engine: Engine, prompt: str) -> int:
    return len(engine.prepare(GenerationRequest("probe", prompt, 1)).prompt_ids)


def test_every_declared_end_of_generation_id_stops_with_eos(ours: LoadedModel) -> None:
    ids = greedy_ids(ours, ours.tokenizer.encode(PROMPT), 8)
    # Declare a greedy token the model has not produced before an end-of-generation id:
    # generation must stop exactly there.
    stop_at = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])
    engine = make_engine(with_tokenizer(ours, eos_token_ids=ours.tokenizer.eos_token_ids | {ids[stop_at]}))
    try:
        job = run(engine, "eos-1")
        end = job.wait()
    finally:
        engine.stop()
    assert end["stop_reason"] == "EOS"
    assert end["tokens_out"] == stop_at
    assert job.text == ours.tokenizer.decode(ids[:stop_at])


def test_injected_step_failure_ends_only_that_job(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    long_prompt = "The capital of France is a city that many people visit, and its name is"
    doomed_at = prompt_length(engine, long_prompt) + 2  # the step that feeds the doomed job's third token
    assert prompt_length(engine, PROMPT) + 10 < doomed_at  # the bystander never gets that far
    fail_at(monkeypatch, lambda s: s.start == doomed_at and len(s.token_ids) == 1,
            RuntimeError("injected kernel failure"))
    doomed, bystander = run(engine, "doomed", long_prompt, max_tokens=50), run(engine, "bystander", max_tokens=10)
    error = doomed.wait()
    assert error == {"type": "error", "code": "INFERENCE_FAILED",
                     "message": "RuntimeError: injected kernel failure"}
    assert bystander.wait()["stop_reason"] == "MAX_TOKENS"
    assert any(e["type"] == "token" for e in doomed.events)  # it had streamed before it failed
    assert run(engine, "after").wait()["type"] == "end"
    assert engine.alive
    assert engine.stats().kv_blocks_used == 0


def test_out_of_memory_is_reported_as_vram_oom(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    huge = "Please summarize the following very long text about many things"
    size = prompt_length(engine, huge)
    assert size != prompt_length(engine, PROMPT)
    fail_at(monkeypatch, lambda s: s.start == 0 and len(s.token_ids) == size,
            torch.OutOfMemoryError("injected: tried to allocate 80 GiB"))
    assert run(engine, "huge", huge).wait()["code"] == "VRAM_OOM"
    assert run(engine, "small").wait()["type"] == "end"


def test_a_queued_job_is_cancelled_at_once(ours: LoadedModel) -> None:
    engine = make_engine(ours, max_running=1)
    try:
        hog = run(engine, "hog", prompt="List the numbers from 1 to 500: 1, 2, 3,", max_tokens=2000)
        queued = run(engine, "queued", max_tokens=5)
        time.sleep(0.3)
        assert engine.cancel("queued")
        end = queued.wait(timeout=10)
        assert not hog.done.is_set()  # the queued job did not wait for the hog
        assert end["stop_reason"] == "CANCELLED"
        assert end["tokens_out"] == 0
        assert [e["type"] for e in queued.events] == ["started", "end"]
        assert engine.cancel("hog")
        assert hog.wait()["stop_reason"] == "CANCELLED"
    finally:
        engine.stop()
    assert engine.stats().kv_blocks_used == 0


def test_metrics_are_spaced_and_end_figures_are_true(engine: Engine) -> None:
    started = time.perf_counter()
    job = run(engine, "timed", max_tokens=40, sampling=SamplingParams(temperature=0.7, seed=5))
    end = job.wait()
    wall_ms = (time.perf_counter() - started) * 1000
    tokens_out = end["tokens_out"]
    metrics = [e for e in job.events if e["type"] == "metrics"]
    assert metrics, "a final metrics event precedes end"
    assert job.events[-2]["type"] in ("metrics", "token")
    assert 0 < end["decode_time_ms"] <= wall_ms
    assert metrics[-1]["tokens_per_sec"] == pytest.approx(tokens_out / end["decode_time_ms"] * 1000, rel=0.2)
    assert metrics[-1]["vram_bytes"] == engine.resident_bytes >= engine.stats().weights_bytes
    # at most about one metrics event a second, plus the final one
    assert len(metrics) <= end["decode_time_ms"] / 1000 + 2


def test_http_failure_yields_error_event_and_next_request_succeeds(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    doomed_prompt = "Hello there, how are you doing on this fine day?"
    size = prompt_length(engine, doomed_prompt)
    fail_at(monkeypatch, lambda s: s.start == 0 and len(s.token_ids) == size, ValueError("injected"))
    state = WorkerState("cpu", "cpu", telemetry=engine.telemetry)
    state.attach(engine)
    client = TestClient(create_app(state))
    body = {"max_tokens": 5, "temperature": 0}
    first = client.post("/execute", json={"job_id": "http-doomed", "prompt": doomed_prompt, **body},
                        headers={"accept": "application/x-ndjson"})
    assert first.status_code == 200
    assert first.text.strip().splitlines()[-1].startswith('{"type":"error","code":"INFERENCE_FAILED"')
    second = client.post("/execute", json={"job_id": "http-fine", "prompt": "Hello", **body},
                         headers={"accept": "application/x-ndjson"})
    assert '"stop_reason":"MAX_TOKENS"' in second.text.strip().splitlines()[-1]
    assert client.get("/health").json()["status"] == "healthy"


def test_request_timeout_ends_overlong_jobs_with_timeout(ours: LoadedModel) -> None:
    engine = make_engine(ours, request_timeout=1.0)
    try:
        started = time.perf_counter()
        slow = run(engine, "slow", prompt="List the numbers from 1 to 500: 1, 2, 3,", max_tokens=2000)
        error = slow.wait(timeout=30)
        elapsed = time.perf_counter() - started
        quick = run(engine, "quick", max_tokens=2)
        assert quick.wait()["type"] == "end"
    finally:
        engine.stop()
    assert error["type"] == "error"
    assert error["code"] == "TIMEOUT"
    assert 1.0 <= elapsed < 5.0
    assert engine.stats().kv_blocks_used == 0
