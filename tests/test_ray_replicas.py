"""llorch engines as Ray Serve replicas: a local Ray cluster, two CPU replicas of the tiny model.

`llorch-ray-serve` is run as a user runs it (it starts its own local cluster and stops it on
SIGTERM); everything is on loopback. Clients reach its front (replicas/front.py), the worker's own
HTTP server with its deadlines for slow clients, which relays each request to Ray's proxy.
The replicas take 4 jobs each plus 2 waiting, and the router keeps a prefix on its replica up to 8
requests more than the other: a burst of 8 requests that share a prefix overfills that replica, and
the gateway must send the 2 it refuses to the other.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Worker, free_port, start_worker, stop_worker
from launch import Server, start_server
from launch import stop as stop_server
from llorch.api.connections import HEADER_TIMEOUT_S
from llorch.device import resolve_backend
from llorch.errors import BackendUnavailable
from llorch.replicas.front import Relay
from soak import address, closed_within, raw_exchange
from tiny_model import write_tiny_gemma3

pytestmark = pytest.mark.cpu

# Speculation off: cancellations here race jobs of a known length, and speculation would finish
# a random model's looping greedy text many times faster.
REPLICA_FLAGS = ("--max-running", "4", "--max-queue", "2", "--log-format", "text", "--speculative", "off")
SHARED_PREFIX = "the a of to in er is and ing " * 24  # 696 characters: 10 of the router's blocks
MODEL = "tiny"


def launcher(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "llorch-ray-serve"), *args]


def replicas_healthy(count: int) -> Callable[[httpx.Response], bool]:
    def ready(response: httpx.Response) -> bool:
        if response.status_code != 200:
            return False
        replicas = response.json().get("replicas", [])
        return sum(r["status"] == "healthy" for r in replicas) == count
    return ready


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A wide MLP: a 2048-token job lives about a second (the narrow model ends it in a tenth, faster than a
    # twin request and a cancel can cross the gateway), so the races below are won by a wide margin.
    return write_tiny_gemma3(tmp_path_factory.mktemp("ray-tiny") / "tiny.gguf", ffn=16384)


@pytest.fixture(scope="module")
def cluster(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("ray-cluster") / "llorch-ray-serve.log"
    server = start_server(
        launcher("--replicas", "2", "--replica-cpus", "1", "--router-imbalance", "8", "--model", str(tiny),
                 "--port", str(port), *REPLICA_FLAGS),
        f"http://127.0.0.1:{port}", ready=replicas_healthy(2), log_path=log)
    yield server
    stop_server(server, timeout=60)


@pytest.fixture(scope="module")
def single(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    worker = start_worker(tmp_path_factory.mktemp("ray-single"), "--model", str(tiny), "--threads", "1")
    yield worker
    stop_worker(worker)


def complete(base_url: str, prompt: str, max_tokens: int = 16) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)


def per_replica(base_url: str, metric: str, **labels: str) -> dict[str, float]:
    """A counter's value on each replica, from the front's /metrics."""
    totals: Counter[str] = Counter()
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == metric and all(sample.labels.get(k) == v for k, v in labels.items()):
                totals[sample.labels.get("replica", "")] += sample.value
    return dict(totals)


def health(base_url: str) -> dict[str, Any]:
    return httpx.get(f"{base_url}/health", timeout=30).json()


def test_health_lists_every_replica_on_its_own_process(cluster: Server) -> None:
    body = health(cluster.base_url)
    assert body["status"] == "healthy" and body["backend"] == "cpu" and body["model"] == "tiny gemma3"
    replicas = body["replicas"]
    assert len(replicas) == 2 and {r["status"] for r in replicas} == {"healthy"}
    assert len({r["pid"] for r in replicas}) == 2 and os.getpid() not in {r["pid"] for r in replicas}
    assert body["vram_bytes"] == sum(r["vram_bytes"] for r in replicas) > 0


def test_concurrent_requests_are_spread_over_both_replicas(cluster: Server) -> None:
    before = per_replica(cluster.base_url, "llorch_requests_total")
    with ThreadPoolExecutor(8) as pool:  # short, distinct prompts: no prefix to be affine to
        answers = list(pool.map(lambda i: complete(cluster.base_url, f"{i} the", 64), range(8)))
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    served_by = Counter(a.headers["x-llorch-replica"] for a in answers)
    assert len(served_by) == 2, served_by
    after = per_replica(cluster.base_url, "llorch_requests_total")
    counted = {replica: after[replica] - before.get(replica, 0) for replica in after}
    assert counted == dict(served_by)  # each replica's own /metrics counts the requests it served


def test_greedy_output_equals_one_plain_worker(cluster: Server, single: Worker) -> None:
    for prompt in ("the a of", "Hello, world", SHARED_PREFIX + "to"):
        ours, theirs = complete(cluster.base_url, prompt, 24), complete(single.base_url, prompt, 24)
        assert ours.status_code == theirs.status_code == 200
        assert ours.json()["choices"][0]["text"] == theirs.json()["choices"][0]["text"]
        assert ours.json()["usage"] == theirs.json()["usage"]
    # The official client, streaming a chat through the front, reads what the plain worker says.
    chats = []
    for url in (cluster.base_url, single.base_url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the a"}],
                                                max_tokens=16, temperature=0, stream=True)
        chats.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    assert chats[0] == chats[1]
    body = {"job_id": "parity", "prompt": "the a of", "max_tokens": 12, "temperature": 0}
    streams = [httpx.post(f"{url}/execute", json=body, timeout=60).text for url in (cluster.base_url, single.base_url)]
    tokens = [[json.loads(line[6:])["t"] for line in s.splitlines() if line.startswith("data: ") and '"token"' in line]
              for s in streams]
    assert tokens[0] == tokens[1] and len(tokens[0]) > 0


def test_shared_prefix_requests_land_on_one_replica_and_reuse_its_cache(cluster: Server) -> None:
    before = per_replica(cluster.base_url, "llorch_prefix_cache_hit_tokens_total")
    served_by = [complete(cluster.base_url, SHARED_PREFIX + f"x{i}", 4).headers["x-llorch-replica"]
                 for i in range(6)]
    assert len(set(served_by)) == 1, served_by
    after = per_replica(cluster.base_url, "llorch_prefix_cache_hit_tokens_total")
    holder = served_by[0]
    assert after[holder] - before.get(holder, 0) >= 5 * 100  # the prefix is ~170 tokens, read from cache 5 times


def test_a_busy_replica_sends_the_request_to_the_other(cluster: Server) -> None:
    prefix = SHARED_PREFIX.upper()  # a prefix no earlier test used
    assert complete(cluster.base_url, prefix, 1).status_code == 200  # one replica now holds it
    retries_before = sum(per_replica(cluster.base_url, "llorch_front_retries_total", reason="busy").values())
    body = {"prompt": prefix, "max_tokens": 2048, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: httpx.post(f"{cluster.base_url}/execute", json={**body, "job_id": f"b{i}"},
                                                     timeout=120), range(8)))
    assert [a.status_code for a in answers] == [200] * 8, [a.text[:200] for a in answers]
    assert all(a.text.count("event: end") == 1 for a in answers)
    assert len({a.headers["x-llorch-replica"] for a in answers}) == 2
    retries = sum(per_replica(cluster.base_url, "llorch_front_retries_total", reason="busy").values())
    assert retries >= retries_before + 2  # the holder refused 2 (it runs 4, 2 wait); the other took them


def test_cancel_reaches_the_replica_holding_the_job(cluster: Server) -> None:
    events: list[dict[str, Any]] = []
    started = threading.Event()
    body = {"job_id": "to-cancel", "prompt": "the a of", "max_tokens": 2048, "temperature": 0}

    def read() -> None:
        with httpx.stream("POST", f"{cluster.base_url}/execute", json=body, timeout=60) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30)
    twin = httpx.post(f"{cluster.base_url}/execute", json=body, timeout=30)  # unique across the cluster too
    assert twin.status_code == 409 and twin.json()["errors"][0]["field"] == "job_id"
    assert httpx.post(f"{cluster.base_url}/cancel", json={"job_id": "to-cancel"}).status_code == 202
    reader.join(60)
    terminal = [e for e in events if e["type"] in ("end", "error")]
    assert len(terminal) == 1 and terminal[0].get("stop_reason") == "CANCELLED", terminal
    assert httpx.post(f"{cluster.base_url}/cancel", json={"job_id": "to-cancel"}).status_code == 404
    assert httpx.post(f"{cluster.base_url}/cancel", json={"job_id": 5}).status_code == 400  # the worker's own check


def outcomes(base_url: str) -> Counter[str]:
    """Requests by outcome, summed over the replicas."""
    totals: Counter[str] = Counter()
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "llorch_requests_total":
                totals[sample.labels.get("outcome", "")] += sample.value
    return totals


def jobs_in_flight(base_url: str) -> int:
    return sum(r["jobs_in_flight"] for r in health(base_url)["replicas"])


def until(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_client_that_goes_away_cancels_its_job_on_the_replica(cluster: Server) -> None:
    """Streaming or not: the proxy tells the front, the front the replica, the replica its engine.

    Each client leaves only once its job runs (one that leaves sooner is rightly never run at all)."""
    url = cluster.base_url
    body = {"model": MODEL, "prompt": "the a of", "max_tokens": 8000, "temperature": 0}  # seconds of work
    before = outcomes(url)

    def cancelled(count: int) -> Callable[[], bool]:
        return lambda: outcomes(url)["cancelled"] - before["cancelled"] == count and jobs_in_flight(url) == 0

    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        assert stream.status_code == 200  # the job is running; the client leaves before reading
    assert until(cancelled(1), 20), f"streamed: {outcomes(url) - before}, {jobs_in_flight(url)} jobs in flight"
    payload = json.dumps(body).encode()
    with socket.create_connection(address(url)) as waiting:  # its answer would come whole, at the end
        waiting.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        assert until(lambda: jobs_in_flight(url) == 1, 20), "the unstreamed job never started"
    assert until(cancelled(2), 20), f"unstreamed: {outcomes(url) - before}, {jobs_in_flight(url)} jobs in flight"


def test_a_client_that_stalls_sending_its_request_is_closed_by_the_header_deadline(cluster: Server) -> None:
    """Ray's proxy kept such connections open for as long as the client liked; the front closes them
    HEADER_TIMEOUT_S after they opened, and answers everyone else meanwhile."""
    half_headers = b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
    opened = time.monotonic()
    stalled = [socket.create_connection(address(cluster.base_url)) for _ in range(6)]
    try:
        for connection in stalled[::2]:  # the others send nothing at all
            connection.sendall(half_headers)
        answered = complete(cluster.base_url, "the a of", 8)
        assert answered.status_code == 200 and answered.json()["choices"][0]["text"]
        assert health(cluster.base_url)["status"] == "healthy"
        closed_after = [closed_within(c, opened + HEADER_TIMEOUT_S + 5 - time.monotonic()) and time.monotonic() - opened
                        for c in stalled]
        # Closed by the deadline: not sooner (a slow client may still finish), not much later.
        assert all(HEADER_TIMEOUT_S - 1 < after < HEADER_TIMEOUT_S + 5 for after in closed_after), closed_after
    finally:
        for connection in stalled:
            connection.close()


def http_body(answer: bytes) -> bytes:
    """The body of a raw HTTP/1.1 answer, chunked or not."""
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    data = bytearray()
    while (size := int(body.split(b"\r\n", 1)[0], 16)) > 0:
        start = body.index(b"\r\n") + 2
        data += body[start:start + size]
        body = body[start + size + 2:]
    return bytes(data)


def test_a_body_framed_twice_is_refused_and_either_framing_alone_is_relayed(cluster: Server) -> None:
    body = json.dumps({"prompt": "the a of"}).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    twice = raw_exchange(cluster.base_url, head + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
    assert twice.startswith(b"HTTP/1.1 400 "), twice[:200]
    assert b"Content-Length and Transfer-Encoding" in twice
    expected = httpx.post(f"{cluster.base_url}/tokenize", json={"prompt": "the a of"}, timeout=30).json()
    for framing in (f"Content-Length: {len(body)}\r\n\r\n".encode() + body,
                    b"Transfer-Encoding: chunked\r\n\r\n" + chunked):
        answer = raw_exchange(cluster.base_url, head + b"Connection: close\r\n" + framing)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        assert json.loads(http_body(answer)) == expected and expected["tokens"]


@pytest.mark.parametrize("accept", ["text/event-stream", "application/x-ndjson"])
def test_events_arrive_through_the_front_as_the_job_produces_them(cluster: Server, accept: str) -> None:
    """The front relays each chunk as it comes: a job's `started` event is read before it decodes, its
    `end` once it is done (an answer held back anywhere would bring both at once)."""
    body = {"job_id": f"live-{accept.split('/')[1]}", "prompt": "the a of", "max_tokens": 2048, "temperature": 0}
    arrivals: list[tuple[float, dict[str, Any]]] = []
    with httpx.stream("POST", f"{cluster.base_url}/execute", json=body, headers={"Accept": accept},
                      timeout=60) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith(accept)
        for line in stream.iter_lines():
            if line.startswith(("{", "data: ")):
                arrivals.append((time.monotonic(), json.loads(line.removeprefix("data: "))))
    (first_at, first), (end_at, end) = arrivals[0], arrivals[-1]
    assert first["type"] == "started" and end["type"] == "end" and end["stop_reason"] == "MAX_TOKENS"
    assert end_at - first_at > 0.5 * end["decode_time_ms"] / 1000, (end_at - first_at, end)


def relayed(handler: Callable[[httpx.Request], Any], method: str, url: str, **kwargs: Any) -> httpx.Response:
    """`method url` sent through the front's relay to `handler`, standing in for Ray's proxy."""
    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as to_ray:
            relay = Relay(to_ray, httpx.URL("http://127.0.0.1:9"))
            transport = httpx.ASGITransport(relay, client=("203.0.113.7", 5000))  # type: ignore[arg-type]
            async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
                return await client.request(method, url, **kwargs)
    return asyncio.run(send())


def test_the_relay_passes_the_request_and_the_answer_less_their_hop_by_hop_headers() -> None:
    seen: list[tuple[httpx.Request, bytes]] = []

    async def events() -> AsyncIterator[bytes]:
        yield b"data: {}\n\n"

    async def ray_proxy(request: httpx.Request) -> httpx.Response:
        seen.append((request, await request.aread()))
        return httpx.Response(201, content=events(), headers=[
            ("Content-Type", "text/event-stream"), ("X-Llorch-Replica", "r1"), ("Connection", "keep-alive, x-hop"),
            ("X-Hop", "1"), ("Keep-Alive", "timeout=90"), ("Server", "uvicorn")])

    answer = relayed(ray_proxy, "POST", "/v1/chat/completions?stream=1&q=a%20b", content=b'{"a": 1}', headers={
        "Content-Type": "application/json", "Authorization": "Bearer k", "Accept": "text/event-stream",
        "X-Custom": "kept", "Connection": "keep-alive, x-hop", "X-Hop": "1", "Keep-Alive": "timeout=5",
        "Upgrade": "h2c", "TE": "trailers", "X-Forwarded-For": "10.0.0.1", "X-Forwarded-Proto": "https"})
    (request, body), = seen
    assert request.method == "POST" and request.url.raw_path == b"/v1/chat/completions?stream=1&q=a%20b"
    assert body == b'{"a": 1}' and request.headers["content-length"] == "8"
    for name, value in (("content-type", "application/json"), ("authorization", "Bearer k"),
                        ("accept", "text/event-stream"), ("x-custom", "kept"), ("host", "127.0.0.1:9"),
                        ("x-forwarded-for", "203.0.113.7"), ("x-forwarded-proto", "http")):  # not what it claims
        assert request.headers.get(name) == value, name
    assert not {"connection", "x-hop", "keep-alive", "upgrade", "te", "transfer-encoding"} & set(request.headers)
    assert answer.status_code == 201 and answer.content == b"data: {}\n\n"
    assert answer.headers["content-type"] == "text/event-stream" and answer.headers["x-llorch-replica"] == "r1"
    assert not {"connection", "x-hop", "keep-alive", "server"} & set(answer.headers)


def test_the_relay_answers_503_in_the_api_s_shape_when_ray_s_proxy_is_unreachable() -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("All connection attempts failed", request=request)

    openai_shaped = relayed(refused, "POST", "/v1/completions", json={"prompt": "x"})
    assert openai_shaped.status_code == 503 and openai_shaped.headers["retry-after"] == "1"
    assert openai_shaped.json()["error"]["code"] == "unavailable"
    assert "cannot be reached" in openai_shaped.json()["error"]["message"]
    worker_shaped = relayed(refused, "GET", "/health")
    assert worker_shaped.status_code == 503 and worker_shaped.json()["errors"][0]["field"] == "worker"


def test_killing_a_replica_ends_its_streams_once_and_it_comes_back(cluster: Server) -> None:
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def stream(name: str, path: str, body: dict[str, Any]) -> None:
        lines: list[str] = []
        record: dict[str, Any] = {"lines": lines}
        with lock:
            results[name] = record
        try:
            with httpx.stream("POST", f"{cluster.base_url}{path}", json=body, timeout=60) as response:
                record["status"], record["replica"] = response.status_code, response.headers.get("x-llorch-replica")
                for line in response.iter_lines():
                    lines.append(line)
        except httpx.HTTPError as exc:  # a closed stream is an allowed ending, recorded
            record["closed"] = repr(exc)

    jobs = [(f"v1-{i}", "/v1/completions", {"model": MODEL, "prompt": f"{i} of", "max_tokens": 8000,
                                            "temperature": 0, "stream": True}) for i in range(4)]
    jobs += [(f"worker-{i}", "/execute", {"job_id": f"kill-{i}", "prompt": f"{i} to", "max_tokens": 2048,
                                          "temperature": 0}) for i in range(2)]
    threads = [threading.Thread(target=stream, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    # Every job accepted and running (the tiny model's greedy text is held back until the end).
    while time.monotonic() < deadline and not (len(results) == len(jobs)
                                               and all("status" in r for r in results.values())):
        time.sleep(0.01)
    victim = results["v1-0"]["replica"]
    pid = next(r["pid"] for r in health(cluster.base_url)["replicas"] if r["replica"] == victim)
    os.kill(pid, signal.SIGKILL)

    after_kill = [complete(cluster.base_url, f"after {i}", 8) for i in range(4)]
    assert [a.status_code for a in after_kill] == [200] * 4, [a.text for a in after_kill]
    assert victim not in {a.headers["x-llorch-replica"] for a in after_kill}
    for thread in threads:
        thread.join(90)

    for name, record in results.items():
        assert record.get("status") == 200, (name, record)
        data = [line[6:] for line in record["lines"] if line.startswith("data: ")]
        if name.startswith("v1-"):  # OpenAI: a finish_reason or an error chunk, then [DONE]
            chunks = [json.loads(d) for d in data if d != "[DONE]"]
            endings = ["error" if "error" in c else "end" for c in chunks
                       if "error" in c or (c.get("choices") and c["choices"][0]["finish_reason"])]
            complete_stream = data[-1:] == ["[DONE]"]
        else:
            endings = [e["type"] for e in map(json.loads, data) if e["type"] in ("end", "error")]
            complete_stream = True
        if "closed" in record:  # an allowed ending: the connection closed, and no terminal event claimed
            assert record["replica"] == victim and not endings, (name, record)
            continue
        assert complete_stream and len(endings) == 1, (name, record["lines"][-3:])
        assert endings == (["error"] if record["replica"] == victim else ["end"]), (name, record["lines"][-3:])
    assert any(r["replica"] == victim for r in results.values())

    deadline = time.monotonic() + 120  # Ray starts a replacement
    while time.monotonic() < deadline:
        replicas = health(cluster.base_url)["replicas"]
        if sum(r["status"] == "healthy" for r in replicas) == 2 and victim not in {r["replica"] for r in replicas}:
            break
        time.sleep(1)
    else:
        pytest.fail(f"no replacement replica: {health(cluster.base_url)}")


def test_a_replica_without_its_backend_fails_with_the_workers_one_line(tiny: Path, tmp_path: Path) -> None:
    """A cuda replica given no GPU by Ray reaches the worker's own backend check and fails there;
    asking for GPUs the cluster lacks fails before any replica starts."""
    try:
        resolve_backend("cuda")
        pytest.skip("this machine has the cuda backend: a replica would start")
    except BackendUnavailable as exc:
        reason = str(exc)
    port = str(free_port())
    no_gpu = subprocess.run(launcher("--backend", "cuda", "--model", str(tiny), "--port", port),
                            capture_output=True, text=True, timeout=120)
    assert no_gpu.returncode == 2
    assert "llorch-ray-serve: error: cuda backend unavailable: the Ray cluster has 0 GPU(s)" in no_gpu.stderr

    failed = subprocess.run(launcher("--backend", "cuda", "--replica-gpus", "0", "--model", str(tiny),
                                     "--port", port, "--log-format", "text"),
                            capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1
    # Ray's own log lines go to stderr too; the launcher's verdict is one line naming the worker's reason.
    verdicts = [line for line in failed.stderr.splitlines() if line.startswith("llorch-ray-serve: error:")]
    assert verdicts == [f"llorch-ray-serve: error: llorch-cuda-worker: error: {reason}"], failed.stderr[-3000:]
