"""The worker API against a real worker subprocess serving the default model."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from conftest import Worker, greedy_ids
from llorch.weights.loader import LoadedModel
from soak import closed_within, scrape

pytestmark = pytest.mark.cpu

TERMINAL = ("end", "error")
# Greedy on this prompt runs to max_tokens without an end-of-generation token (the
# 256-token test proves it), so a job built on it stays in flight until cancelled.
LONG_RUNNING = {"prompt": "List the numbers from 1 to 500: 1, 2, 3,", "temperature": 0}


def read_sse(response: httpx.Response) -> list[dict[str, Any]]:
    """Events of an SSE stream, checking each frame's `event:` name against its data's type."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            event = json.loads(line.removeprefix("data: "))
            assert event["type"] == name
            events.append(event)
    return events


def execute(worker: Worker, body: dict[str, Any], **headers: str) -> tuple[httpx.Response, list[dict[str, Any]]]:
    with worker.client() as client, client.stream("POST", "/execute", json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            return response, []
        if response.headers["content-type"].startswith("application/x-ndjson"):
            return response, [json.loads(line) for line in response.iter_lines() if line]
        return response, read_sse(response)


def assert_contract_order(events: list[dict[str, Any]], job_id: str) -> None:
    assert events[0]["type"] == "started"
    assert events[0]["job_id"] == job_id
    assert events[0]["model"]
    assert "T" in events[0]["started_at"]
    assert [e["type"] for e in events].count("started") == 1
    assert events[-1]["type"] in TERMINAL
    assert sum(e["type"] in TERMINAL for e in events) == 1
    middle = [e["type"] for e in events[1:-1]]
    assert set(middle) <= {"token", "metrics"}
    tokens = [e for e in events if e["type"] == "token"]
    assert [e["i"] for e in tokens] == list(range(len(tokens)))


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["t"] for e in events if e["type"] == "token")


def test_health_reports_the_contract_fields(worker: Worker) -> None:
    body = httpx.get(f"{worker.base_url}/health").json()
    assert body["status"] == "healthy"
    assert body["backend"] == "cpu"
    assert body["device"] == "cpu"
    assert body["model"]
    assert body["vram_bytes"] > 250_000_000  # the int8 weights alone are about 300 MB


def test_greedy_stream_follows_the_contract_and_reassembles_exactly(worker: Worker, served: LoadedModel) -> None:
    prompt = "The capital of France is"
    response, events = execute(worker, {"job_id": "greedy-1", "prompt": prompt, "max_tokens": 24,
                                        "temperature": 0})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert_contract_order(events, "greedy-1")
    expected_ids = greedy_ids(served, served.tokenizer.encode(prompt), 24)
    assert text_of(events) == served.tokenizer.decode(expected_ids)
    end = events[-1]
    assert end["type"] == "end"
    assert end["tokens_out"] == len(expected_ids)
    assert end["stop_reason"] == ("MAX_TOKENS" if len(expected_ids) == 24 else "EOS")
    assert end["decode_time_ms"] > 0


def test_same_seed_gives_the_same_tokens(worker: Worker) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "seed": 2**64 - 5}
    _, first = execute(worker, {"job_id": "seed-a", **body})
    _, second = execute(worker, {"job_id": "seed-b", **body})
    assert [e for e in first if e["type"] == "token"] == [e for e in second if e["type"] == "token"]
    assert first[-1]["tokens_out"] == second[-1]["tokens_out"]


def test_ndjson_when_the_client_asks_for_it(worker: Worker) -> None:
    response, events = execute(worker, {"job_id": "nd-1", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
                               accept="application/x-ndjson")
    assert response.headers["content-type"].startswith("application/x-ndjson")
    assert_contract_order(events, "nd-1")


def test_every_violation_is_listed_in_one_400(worker: Worker) -> None:
    body = {"job_id": "", "max_tokens": 0, "temperature": 2.5, "top_p": 1.5, "top_k": -1, "min_p": -0.1,
            "repetition_penalty": 3, "seed": -1, "stop": ["a", "b", "c", "d", "e"], "colour": "blue"}
    response = httpx.post(f"{worker.base_url}/execute", json=body)
    assert response.status_code == 400
    errors = response.json()["errors"]
    by_field = {e["field"]: e for e in errors}
    assert set(by_field) == {"job_id", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                             "repetition_penalty", "seed", "stop", "colour"}
    assert by_field["prompt"]["constraint"] == "required"
    assert by_field["colour"]["constraint"] == "unknown field"
    assert by_field["max_tokens"]["value"] == 0
    assert all(e["message"] for e in errors)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"job_id": "v", "prompt": "x" * 32769, "max_tokens": 1}, "prompt"),
        ({"job_id": "v", "prompt": "hi", "max_tokens": 2049}, "max_tokens"),
        ({"job_id": "v", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"job_id": "v", "prompt": "hi", "max_tokens": 5, "stop": ["x" * 101]}, "stop.0"),
        ({"job_id": "v", "prompt": "hi", "max_tokens": 5, "stop": [""]}, "stop.0"),
        ({"job_id": "v", "prompt": "hi", "max_tokens": 5, "seed": 2**64}, "seed"),
    ],
)
def test_each_rule_is_enforced(worker: Worker, body: dict[str, Any], field: str) -> None:
    response = httpx.post(f"{worker.base_url}/execute", json=body)
    assert response.status_code == 400
    assert [e["field"] for e in response.json()["errors"]] == [field]


def test_malformed_json_is_a_clear_400(worker: Worker) -> None:
    response = httpx.post(f"{worker.base_url}/execute", content=b'{"job_id": "x", ',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["errors"][0]["constraint"] == "valid JSON"


def test_a_body_that_is_not_an_object_is_a_clear_400(worker: Worker) -> None:
    response = httpx.post(f"{worker.base_url}/execute", json=["job_id", "prompt"])
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "body"


def test_stop_sequence_over_http(worker: Worker) -> None:
    _, events = execute(worker, {"job_id": "stop-http", "prompt": "The capital of France is", "max_tokens": 24,
                                 "temperature": 0, "stop": [" country"]})
    assert_contract_order(events, "stop-http")
    assert " country" not in text_of(events)
    assert events[-1]["stop_reason"] == "STOP_SEQUENCE"
    assert events[-1]["stop_sequence_matched"] == " country"


def test_oversized_body_is_413(worker: Worker) -> None:
    response = httpx.post(f"{worker.base_url}/execute", content=b"x" * (2 << 20))
    assert response.status_code == 413


def kv_held(worker: Worker) -> int:
    """Bytes of the KV pool that jobs hold now (the pool itself is allocated at start-up)."""
    return int(scrape(worker.base_url)["llorch_kv_cache_bytes"])


def wait_for_idle(worker: Worker) -> int:
    deadline = time.monotonic() + 10
    while (held := kv_held(worker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


def test_cancel_ends_the_stream_and_frees_the_kv_cache(worker: Worker) -> None:
    vram = httpx.get(f"{worker.base_url}/health").json()["vram_bytes"]
    assert wait_for_idle(worker) == 0
    body = {"job_id": "cancel-me", "max_tokens": 2048, **LONG_RUNNING}
    events: list[dict[str, Any]] = []
    with worker.client() as client, client.stream("POST", "/execute", json=body) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "token":
                    break
        assert kv_held(worker) > 0
        assert httpx.post(f"{worker.base_url}/cancel", json={"job_id": "cancel-me"}).status_code == 202
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[-1]["type"] == "end"
    assert events[-1]["stop_reason"] == "CANCELLED"
    assert events[-1]["tokens_out"] < 2048
    assert wait_for_idle(worker) == 0
    # vram_bytes is the weights plus the whole pool, allocated once: it does not move.
    assert httpx.get(f"{worker.base_url}/health").json()["vram_bytes"] == vram


def test_cancel_of_an_unknown_job_is_404(worker: Worker) -> None:
    assert httpx.post(f"{worker.base_url}/cancel", json={"job_id": "never-seen"}).status_code == 404


def test_client_disconnect_cancels_the_job(worker: Worker) -> None:
    body = {"job_id": "walk-away", "max_tokens": 2048, **LONG_RUNNING}
    with worker.client() as client, client.stream("POST", "/execute", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "token":
                break
    assert wait_for_idle(worker) == 0
    # The job is gone: nothing left to cancel.
    assert httpx.post(f"{worker.base_url}/cancel", json={"job_id": "walk-away"}).status_code == 404


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_a_non_streaming_request_cancels_its_jobs(worker: Worker, path: str) -> None:
    """Nothing is written until the answer is whole, yet the worker notices the client leaving and stops."""
    model = httpx.get(f"{worker.base_url}/v1/models").json()["data"][0]["id"]
    body: dict[str, Any] = {"model": model, "max_tokens": 2048, "temperature": 0, "n": 2}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": LONG_RUNNING["prompt"]}]
    else:
        body["prompt"] = LONG_RUNNING["prompt"]
    generated_before = float(scrape(worker.base_url)["llorch_generated_tokens_total"])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{worker.base_url}{path}", json=body, timeout=httpx.Timeout(30, read=1.5))
    assert wait_for_idle(worker) == 0
    generated = float(scrape(worker.base_url)["llorch_generated_tokens_total"]) - generated_before
    time.sleep(1)  # nothing goes on generating after the blocks are freed
    assert float(scrape(worker.base_url)["llorch_generated_tokens_total"]) - generated_before == generated
    assert generated < 2 * 2048


@pytest.mark.parametrize("prompt_tokens", [1, 100, 1000])
def test_prompts_of_1_100_and_1000_tokens(worker: Worker, ours: LoadedModel, prompt_tokens: int) -> None:
    prompt = "hello" + " hello" * (prompt_tokens - 1)
    assert len(ours.tokenizer.encode(prompt)) == prompt_tokens + 1  # + BOS
    _, events = execute(worker, {"job_id": f"len-{prompt_tokens}", "prompt": prompt, "max_tokens": 8,
                                 "temperature": 0})
    assert_contract_order(events, f"len-{prompt_tokens}")
    assert events[-1]["type"] == "end"


def test_a_256_token_generation_completes(worker: Worker) -> None:
    _, events = execute(worker, {"job_id": "long-256", "max_tokens": 256, **LONG_RUNNING})
    assert_contract_order(events, "long-256")
    end = events[-1]
    assert end["type"] == "end"
    assert end["stop_reason"] == "MAX_TOKENS"
    assert end["tokens_out"] == 256


def test_a_job_id_in_flight_cannot_be_reused(worker: Worker) -> None:
    body = {"job_id": "twin", "max_tokens": 2048, **LONG_RUNNING}
    with worker.client() as client, client.stream("POST", "/execute", json=body) as response:
        # One iterator, kept alive: a loop broken out of would close the connection,
        # which the worker rightly treats as a disconnect that cancels the job.
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        second = httpx.post(f"{worker.base_url}/execute", json={**body, "max_tokens": 1})
        assert second.status_code == 409
        assert second.json()["errors"][0]["field"] == "job_id"
        httpx.post(f"{worker.base_url}/cancel", json={"job_id": "twin"})
        assert '"stop_reason":"CANCELLED"' in [line for line in lines if line.startswith("data: ")][-1]


@pytest.mark.parametrize("path", ["/execute", "/cancel", "/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("body", [
    b"[" * 5000 + b"]" * 5000, b'{"prompt": "\\ud800"}', b'{"job_id": "\\udfff"}', b'{"temperature": NaN}',
    b'{"temperature": Infinity}', b'{"temperature": 1e400}', b'{"max_tokens": ' + b"9" * 5000 + b"}"])
def test_malformed_bodies_are_400s_in_the_api_shape(worker: Worker, path: str, body: bytes) -> None:
    answer = httpx.post(f"{worker.base_url}{path}", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()
    if path == "/execute" or path == "/cancel":
        assert error["errors"][0]["field"] == "body" and "JSON" in error["errors"][0]["message"]
    else:
        assert error["error"]["type"] == "invalid_request_error" and "JSON" in error["error"]["message"]


def test_unknown_routes_answer_in_the_api_shape(worker: Worker) -> None:
    assert httpx.get(f"{worker.base_url}/v1/nothing").json()["error"]["code"] == "not_found"
    assert httpx.get(f"{worker.base_url}/nothing").json()["errors"][0]["field"] == "path"
    wrong_method = httpx.get(f"{worker.base_url}/execute")
    assert wrong_method.status_code == 405 and wrong_method.json()["errors"][0]["field"] == "path"


def test_slow_and_idle_connections_cannot_hold_the_server(worker: Worker) -> None:
    """300 connections that send nothing, half their headers, or half their body: /health and real
    requests are still answered at once, and each slow connection is closed by its read deadline."""
    import socket

    from llorch.api.connections import BODY_TIMEOUT_S, HEADER_TIMEOUT_S

    host, port = worker.base_url.removeprefix("http://").split(":")
    half_headers = b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
    half_body = half_headers + b"Content-Type: application/json\r\n\r\n{\"job_id\": "
    opened = time.monotonic()
    slow: dict[bytes, list[socket.socket]] = {b"": [], half_headers: [], half_body: []}
    try:
        for i in range(300):
            sent = list(slow)[i % 3]
            connection = socket.create_connection((host, int(port)))
            connection.sendall(sent)
            slow[sent].append(connection)
        with worker.client() as client:
            for _ in range(5):
                started = time.monotonic()
                assert client.get("/health").status_code == 200
                assert time.monotonic() - started < 1.0
            assert client.get("/v1/models").status_code == 200

        header_deadline = opened + HEADER_TIMEOUT_S + 3
        for connection in slow[b""] + slow[half_headers]:
            assert closed_within(connection, header_deadline - time.monotonic())
        body_deadline = opened + BODY_TIMEOUT_S + 3
        for connection in slow[half_body]:
            assert closed_within(connection, body_deadline - time.monotonic())
    finally:
        for connection in (c for group in slow.values() for c in group):
            connection.close()


def test_a_request_without_max_tokens_holds_kv_only_for_its_tokens(worker: Worker, ours: LoadedModel) -> None:
    """No max_tokens means "until EOS or the context", with KV blocks taken as tokens come: the
    context is never reserved up front. (Leaving the stream cancels the job.)"""
    from llorch.engine.kv.pool import BLOCK_SIZE, bytes_per_block

    block = bytes_per_block(ours.config, ours.dtype)
    body = {"model": "m", "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]}
    with worker.client() as client:
        model = client.get("/v1/models").json()["data"][0]
        body["model"] = model["id"]
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks, held = 0, 0.0
            for line in response.iter_lines():  # (leaving this loop closes the stream)
                chunks += line.startswith("data: ")
                if chunks == 40:
                    held = scrape(worker.base_url)["llorch_kv_cache_bytes"]
                    break
    # The prompt and ~40 tokens fit in a few blocks; the context would take thousands.
    assert 0 < held <= (128 // BLOCK_SIZE + 2) * block, held
    assert model["max_model_len"] * block // BLOCK_SIZE > 50 * held


def test_ids_and_names_are_length_bounded(worker: Worker) -> None:
    """A huge job_id or model name is a 400, not megabytes in every event and log line."""
    huge = "j" * (1 << 19)  # half a MiB: within the body limit
    with worker.client() as client:
        for path in ("/execute", "/cancel"):
            body = {"job_id": huge, "prompt": "Hello", "max_tokens": 1} if path == "/execute" else {"job_id": huge}
            answer = client.post(path, json=body)
            assert answer.status_code == 400, path
            assert answer.json()["errors"][0]["field"] == "job_id"
            assert len(answer.content) < 4096
        answer = client.post("/v1/completions", json={"model": huge, "prompt": "Hello", "max_tokens": 1})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"
        assert len(answer.content) < 4096


def test_openai_prompts_are_bounded_before_tokenizing(worker: Worker) -> None:
    from llorch.api.fields import MAX_PROMPT_CHARS

    text = "word " * (MAX_PROMPT_CHARS // 5 + 1)
    with worker.client() as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        answers = [
            client.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 1}),
            client.post("/v1/completions", json={"model": model, "prompt": ["short", text], "max_tokens": 1}),
            client.post("/v1/chat/completions", json={"model": model, "max_tokens": 1,
                                                      "messages": [{"role": "user", "content": text}]}),
        ]
    for answer in answers:
        assert answer.status_code == 400 and f"at most {MAX_PROMPT_CHARS}" in answer.json()["error"]["message"]


def test_openai_errors_list_every_violation_and_say_why(worker: Worker) -> None:
    """One message names every problem ("param: why; ..."), and content parts say what is unsupported."""
    with worker.client() as client:
        model = client.get("/v1/models").json()["data"][0]["id"]

        def chat(**fields: Any) -> dict[str, Any]:
            answer = client.post("/v1/chat/completions", json={"model": model, **fields})
            assert answer.status_code == 400, answer.text
            return answer.json()["error"]

        user = [{"role": "user", "content": "Hi"}]
        both = chat(messages=user, temperature=-1, top_p=5)
        assert both["param"] == "temperature" and "temperature:" in both["message"] and "top_p:" in both["message"]
        image = chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
        assert "content part 1 has type 'image_url'" in image["message"] and "text parts only" in image["message"]
        assert image["param"] == "messages.0.content"
        orphan = chat(messages=[*user, {"role": "tool", "content": "42"}])
        assert "a tool message needs the tool_call_id it answers" in orphan["message"]
        shaped = chat(messages=[{"role": "user", "content": {"text": "Hi"}}])
        assert "content must be a string, a list of text parts or null, not dict" in shaped["message"]


def test_the_cpu_worker_serves_a_gguf_file_without_torch(worker: Worker, client: Any, model_id: str) -> None:
    """The C step's path imports no torch (about a second of start-up and 190 MB): not at start, not for
    greedy or seeded sampling, log-probabilities, stops or a JSON schema's constrained output."""
    greedy = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, logprobs=2, stop=["\n\n"])
    assert greedy.choices[0].logprobs.top_logprobs
    sampled = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=24, temperature=0.8,
        seed=7, response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": {
            "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]}}})
    assert "colour" in json.loads(sampled.choices[0].message.content)
    with open(f"/proc/{worker.process.pid}/maps") as maps:
        assert "libtorch" not in maps.read()
