"""Hostile input: schema-driven API fuzzing, fuzzed model headers, and the limits in between.

The server-side tests use a tiny random Gemma 3 the test writes itself, so hundreds of
generated requests run in seconds; the worker code under test is the real one.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from jobs import make_engine
from llorch.api.app import create_app
from llorch.api.state import WorkerState
from llorch.engine.request import GenerationRequest
from llorch.errors import ModelFileError, StartupError
from llorch.weights.gguf import GGUFFile
from llorch.weights.loader import load_model
from tiny_model import write_tiny_gemma3

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_state(tiny_path: Path) -> Iterator[WorkerState]:
    loaded = load_model(tiny_path, torch.device("cpu"), torch.float32)
    # A small context: a fuzzed request with no token limit (valid on every generating route) runs to the
    # end of the context, which must stay well inside the fuzzer's read timeout.
    engine = make_engine(loaded, ctx_size=512, kv_cache_bytes=16 * 2**20, max_running=16)
    state = WorkerState("cpu", "cpu", telemetry=engine.telemetry)
    state.attach(engine)
    yield state
    engine.stop()


@pytest.fixture(scope="module")
def tiny_app(tiny_state: WorkerState):  # type: ignore[no-untyped-def]
    return create_app(tiny_state)


# -- the API against its own OpenAPI schema ------------------------------------------------

# Per operation. The suite stays bounded; README shows the longer run (LLORCH_FUZZ_EXAMPLES=1000).
API_EXAMPLES = int(os.environ.get("LLORCH_FUZZ_EXAMPLES", "25"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_no_5xx_and_every_response_matches_the_schema(tiny_app) -> None:  # type: ignore[no-untyped-def]
    api_schema = schemathesis.openapi.from_asgi("/openapi.json", tiny_app)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/execute", "/cancel", "/health", "/v1/completions",
                                              "/v1/chat/completions", "/tokenize", "/detokenize",
                                              "/tokenizer_info"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=API_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        def exercise(case) -> None:  # type: ignore[no-untyped-def]
            case.call_and_validate(checks=CHECKS)

        exercise()


# -- model files are untrusted input --------------------------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(cut=st.integers(min_value=0, max_value=200_000))
def test_truncated_model_files_fail_cleanly(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                           cut: int) -> None:
    data = tiny_path.read_bytes()
    damaged = tmp_path_factory.mktemp("cut") / "cut.gguf"
    damaged.write_bytes(data[: min(cut, len(data) - 1)])
    with pytest.raises(ModelFileError):
        load_model(damaged, torch.device("cpu"), torch.float32)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_corrupted_headers_fail_cleanly_or_load(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                               data: st.DataObject) -> None:
    """Random bytes overwritten in the header: a clean ModelFileError, or a file that still loads."""
    raw = bytearray(tiny_path.read_bytes())
    header_end = 8_000
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(4, header_end))
        value = data.draw(st.sampled_from([b"\xff" * 8, struct.pack("<Q", 1 << 62), struct.pack("<I", 99),
                                           b"\x00" * 4, data.draw(st.binary(min_size=1, max_size=8))]))
        raw[at : at + len(value)] = value
    damaged = tmp_path_factory.mktemp("bad") / "bad.gguf"
    damaged.write_bytes(bytes(raw))
    try:
        load_model(damaged, torch.device("cpu"), torch.float32)
    except StartupError as exc:
        assert str(damaged) in str(exc)


@pytest.mark.parametrize("field_offset", [8, 16])  # tensor count, metadata count
def test_huge_counts_are_refused_before_any_allocation(tiny_path: Path, tmp_path: Path, field_offset: int) -> None:
    raw = bytearray(tiny_path.read_bytes())
    raw[field_offset : field_offset + 8] = struct.pack("<Q", (1 << 63) - 1)
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="exceed the file size"):
        GGUFFile(crafted)


def test_a_huge_string_length_is_refused(tiny_path: Path, tmp_path: Path) -> None:
    raw = bytearray(tiny_path.read_bytes())
    raw[24:32] = struct.pack("<Q", 1 << 60)  # the first metadata key's length
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="runs past the end of the file"):
        GGUFFile(crafted)


# -- observability --------------------------------------------------------------------------

def metric_samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_counters_move_with_requests(tiny_app, tiny_state: WorkerState) -> None:  # type: ignore[no-untyped-def]
    client = TestClient(tiny_app)
    before = metric_samples(client)
    body = {"job_id": "counted", "prompt": "the cat", "max_tokens": 5, "temperature": 0}
    assert client.post("/execute", json=body).status_code == 200
    assert client.post("/execute", json={"job_id": "bad", "max_tokens": 0}).status_code == 400
    after = metric_samples(client)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    ended = delta("llorch_requests_total", outcome="max_tokens") + delta("llorch_requests_total", outcome="eos")
    assert ended == 1
    assert delta("llorch_requests_total", outcome="rejected_invalid") == 1
    assert tiny_state.engine is not None
    prepared = tiny_state.engine.prepare(GenerationRequest("count", "the cat", 1))
    assert delta("llorch_prompt_tokens_total") == len(prepared.prompt_ids)
    assert 1 <= delta("llorch_generated_tokens_total") <= 5
    assert delta("llorch_time_to_first_token_seconds_count") == 1
    assert after[("llorch_running_jobs", ())] == 0
    assert after[("llorch_kv_cache_bytes", ())] == 0
    assert after[("llorch_weights_bytes", ())] > 0


def test_correlation_id_is_echoed_or_minted(tiny_app) -> None:  # type: ignore[no-untyped-def]
    client = TestClient(tiny_app)
    assert client.get("/health", headers={"X-Correlation-ID": "trace-42"}).headers["X-Correlation-ID"] == "trace-42"
    assert len(client.get("/health").headers["X-Correlation-ID"]) == 32


def test_loading_and_draining_workers_refuse_jobs_with_503() -> None:
    state = WorkerState("cpu", "cpu")
    client = TestClient(create_app(state))
    health = client.get("/health").json()
    assert health["status"] == "loading"
    assert "progress" in health
    response = client.post("/execute", json={"job_id": "early", "prompt": "x", "max_tokens": 1})
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert client.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 503
    state.draining = True
    assert client.get("/health").json()["status"] == "draining"


def test_a_non_streamed_answer_is_built_and_encoded_off_the_event_loop() -> None:
    """Megabytes of JSON (a long answer with log-probabilities) must not stall every stream: the answer
    is built and encoded on a worker thread, into the bytes JSONResponse would send."""
    import asyncio
    import threading

    from fastapi.responses import JSONResponse

    from llorch.api.json_answer import json_answer

    body = {"text": "é ✓", "logprobs": [{"token": "a", "logprob": -0.25}] * 3, "n": None}
    builders: list[threading.Thread] = []

    def build() -> dict[str, object]:
        builders.append(threading.current_thread())
        return body

    async def answer() -> tuple[threading.Thread, object]:
        return threading.current_thread(), await json_answer(build)

    loop_thread, response = asyncio.run(answer())
    assert builders and builders[0] is not loop_thread
    assert response.body == JSONResponse(body).body and response.media_type == "application/json"  # type: ignore[attr-defined]
    with pytest.raises(ValueError):  # no NaN on the wire, as JSONResponse
        asyncio.run(json_answer(lambda: {"logprob": float("nan")}))
