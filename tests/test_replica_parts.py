"""The Ray Serve front's parts that need no cluster: prefix affinity, the routing text, the in-process
relay through the worker's app, the merged metrics, and how a lost stream ends."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llorch.api.streaming import NDJSON, SSE
from llorch.replicas.affinity import BLOCK_CHARS, PrefixAffinity
from llorch.replicas.gateway import lost_stream_ending, merge_expositions
from llorch.replicas.relay import RelayedRequest, RelayedStart, answer_in_process, routing_text

pytestmark = pytest.mark.cpu

PREFIX = "You are a helpful assistant. " * 10  # 290 characters: 4 whole blocks


def test_the_replica_that_read_the_longest_prefix_is_preferred() -> None:
    affinity = PrefixAffinity()
    affinity.record(PREFIX + "question one", "b")
    affinity.record(PREFIX[:2 * BLOCK_CHARS], "a")  # a read the first two blocks since (each block: its last reader)
    assert affinity.lookup(PREFIX + "question two", {"a", "b"}) == ("b", 4 * BLOCK_CHARS)
    assert affinity.lookup(PREFIX + "question two", {"a"}) == ("a", 2 * BLOCK_CHARS)  # b is gone
    assert affinity.lookup("something else entirely, and long enough to fill a block or two.", {"a", "b"}) == (None, 0)
    assert affinity.lookup("short", {"a", "b"}) == (None, 0)  # less than a block: no preference
    affinity.forget("b")
    assert affinity.lookup(PREFIX, {"a", "b"}) == ("a", 2 * BLOCK_CHARS)


def test_the_affinity_table_stays_bounded() -> None:
    affinity = PrefixAffinity(max_keys=8)
    for i in range(10):
        affinity.record(f"{i:04d}" * 64, f"r{i}")  # 4 blocks each
    assert len(affinity) == 8
    assert affinity.lookup("0009" * 64, {"r9"}) == ("r9", 4 * BLOCK_CHARS)
    assert affinity.lookup("0000" * 64, {"r0"}) == (None, 0)  # least recently used: forgotten


def test_routing_text_is_what_the_model_reads_first() -> None:
    assert routing_text("/execute", {"prompt": "hello", "job_id": "x"}) == "hello"
    assert routing_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    same_system = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]}
    text, other = routing_text("/v1/chat/completions", chat), routing_text("/v1/chat/completions", same_system)
    assert text.startswith("system\x00be brief\x00user\x00hi") and other.startswith("system\x00be brief\x00user")
    assert routing_text("/v1/models", {"prompt": "x"}) == ""
    # The same routes without /v1, and llama-server's /completion, route by their prompts too.
    assert routing_text("/chat/completions", chat) == text
    assert routing_text("/completions", {"prompt": "hello"}) == routing_text("/completion", {"prompt": "hello"}) \
        == "hello"
    assert routing_text("/execute", ["not", "an", "object"]) == ""
    assert len(routing_text("/execute", {"prompt": "x" * 100_000})) == 8192


def test_routing_text_of_a_chat_with_tools_starts_with_the_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = routing_text("/v1/chat/completions", {"tools": tools, "messages": [{"role": "user", "content": "x"}]})
    assert text.startswith(json.dumps(tools, sort_keys=True))


def _app(cancelled: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"body": (await request.body()).decode(), "auth": request.headers.get("authorization"),
                             "query": request.url.query}, 201, headers={"X-Thing": "1"})

    @app.get("/slow")
    async def slow() -> StreamingResponse:
        async def chunks():
            try:
                for i in range(1000):
                    yield f"chunk {i}\n".encode()
                    await asyncio.sleep(0.01)
            finally:
                cancelled.append("slow")

        return StreamingResponse(chunks(), media_type="text/plain")

    return app


def _request(method: str, path: str, body: bytes = b"", query: bytes = b"") -> RelayedRequest:
    return RelayedRequest(method, path, query, (("Authorization", "Bearer k"), ("Content-Type", "application/json")),
                          body)


def test_a_relayed_request_is_answered_by_the_app_as_sent() -> None:
    async def run() -> list[RelayedStart | bytes]:
        request = _request("POST", "/echo", b'{"a": 1}', b"x=1")
        return [item async for item in answer_in_process(_app([]), request, "r1")]

    start, *body = asyncio.run(run())
    assert isinstance(start, RelayedStart) and start.status == 201 and start.replica == "r1"
    assert start.header("x-thing") == "1"
    assert json.loads(b"".join(body)) == {"body": '{"a": 1}', "auth": "Bearer k", "query": "x=1"}


def test_a_relay_that_stops_being_read_tells_the_app_its_client_left() -> None:
    cancelled: list[str] = []

    async def run() -> None:
        stream = answer_in_process(_app(cancelled), _request("GET", "/slow"), "r1")
        start = await stream.__anext__()
        assert isinstance(start, RelayedStart) and start.status == 200
        assert (await stream.__anext__()).startswith(b"chunk 0")
        await stream.aclose()  # what a cancelled Ray stream does

    asyncio.run(run())
    assert cancelled == ["slow"]


def _exposition(counts: dict[str, int]) -> str:
    registry = CollectorRegistry()
    counter = Counter("llorch_requests", "Requests", ["outcome"], registry=registry)
    for outcome, count in counts.items():
        counter.labels(outcome=outcome).inc(count)
    return generate_latest(registry).decode()


def test_merged_metrics_keep_each_replica_apart_under_one_family() -> None:
    merged = merge_expositions([{"replica": "a", "text": _exposition({"eos": 2})},
                                {"replica": "b", "text": _exposition({"eos": 3, "cancelled": 1})}]).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    samples = {(s.labels["replica"], s.labels["outcome"]): s.value
               for s in families["llorch_requests"].samples if s.name == "llorch_requests_total"}
    assert samples == {("a", "eos"): 2, ("b", "eos"): 3, ("b", "cancelled"): 1}
    assert merged.count("# TYPE llorch_requests_total counter") == 1


@pytest.mark.parametrize(("path", "content_type"), [("/execute", SSE), ("/execute", NDJSON),
                                                    ("/v1/chat/completions", SSE)])
def test_a_stream_whose_replica_died_ends_with_one_error_in_its_own_framing(path: str, content_type: str) -> None:
    ending = lost_stream_ending(path, content_type).decode()
    if path == "/execute" and content_type == NDJSON:
        event = json.loads(ending)
    elif path == "/execute":
        assert ending.startswith("event: error\n")
        event = json.loads(ending.split("data: ", 1)[1])
    else:
        first, done = [part for part in ending.split("\n\n") if part]
        assert done == "data: [DONE]"
        event = json.loads(first.removeprefix("data: "))["error"]
        assert event["code"] == "replica_lost"
        return
    assert event["type"] == "error" and event["code"] == "INFERENCE_FAILED" and "replica" in event["message"]
