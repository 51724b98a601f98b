"""Clients that stop reading their answers cannot hold the worker: the write deadline resets them.

A client that sends a request and never reads the answer used to keep its request slot,
its connection and its jobs for as long as it liked: eight of them on a worker with
`--max-connections 8` made every other request a 503. Now a connection whose client has
left a full send buffer unread for WRITE_TIMEOUT_S is reset, its jobs end like any
disconnect's, and its slot is free; a new connection past the limit evicts the connection
left unread longest, as it evicts idle ones.

The worker serves a tiny model with a long context; each stalled client has a 4 KiB receive
buffer and asks for two streamed choices of 60000 tokens with five alternatives each, so
the worker's buffers fill within seconds and its jobs still run when the deadline strikes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import Worker, start_worker, stop_worker
from hostile_files import U32, tiny_gemma3_parts
from llorch.api.connections import WRITE_TIMEOUT_S
from soak import closed_by_peer, ended_jobs, scrape, stalled_request

pytestmark = pytest.mark.cpu

MAX_CONNECTIONS = 8
# Eight such requests are 16 jobs, all running at once (--max-running 16); none ends by itself in the test.
NEVER_READ = {"prompt": "the", "max_tokens": 60000, "n": 2, "logprobs": 5, "ignore_eos": True, "stream": True}
GENERATION_S = 60  # for the answers to outgrow the worker's buffers on a loaded machine (seconds, in fact)


@pytest.fixture(scope="module")
def tiny_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    workdir = tmp_path_factory.mktemp("tiny")
    path = tiny_gemma3_parts(workdir).set("gemma3.context_length", U32, 65536).write(workdir / "long.gguf")
    live = start_worker(workdir, "--model", str(path), "--max-connections", str(MAX_CONNECTIONS))
    yield live
    stop_worker(live)


def received_until_closed(connection: socket.socket) -> bytes:
    """What the client had received when the worker closed the connection (read only now)."""
    connection.settimeout(5)
    data = bytearray()
    try:
        while chunk := connection.recv(1 << 16):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return bytes(data)


def settled(worker: Worker, accepted_before: float, ended_before: int) -> dict[str, float]:
    """The worker's metrics once every job it accepted has ended (or after a deadline only a hang misses)."""
    give_up = time.monotonic() + 30
    while True:
        samples = scrape(worker.base_url)
        accepted = samples["llorch_jobs_accepted_total"] - accepted_before
        if ended_jobs(samples) - ended_before >= accepted or time.monotonic() > give_up:
            return samples
        time.sleep(0.2)


def test_clients_that_never_read_lose_their_connection_jobs_and_slot(tiny_worker: Worker) -> None:
    """Seven stalled clients beside one real one (eight connections: nothing is evicted): each stalled
    connection is reset by the write deadline before its answer is complete, its still-running jobs
    are cancelled, and no job or KV block is left."""
    url = tiny_worker.base_url
    with httpx.Client(base_url=url, timeout=30) as real:  # connected first: one of the eight
        before = scrape(url)
        assert real.get("/health").status_code == 200
        stalled = [stalled_request(url, "/v1/completions", NEVER_READ) for _ in range(MAX_CONNECTIONS - 1)]
        try:
            give_up = time.monotonic() + GENERATION_S + WRITE_TIMEOUT_S
            while not all(closed_by_peer(c) for c in stalled) and time.monotonic() < give_up:
                assert real.get("/health").status_code == 200  # keeps the connection alive, and answers
                time.sleep(0.5)
            assert all(closed_by_peer(c) for c in stalled), "the worker kept connections nobody read"
            for connection in stalled:
                received = received_until_closed(connection)
                assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
        finally:
            for connection in stalled:
                connection.close()
        samples = settled(tiny_worker, before["llorch_jobs_accepted_total"], ended_jobs(before))
        accepted = samples["llorch_jobs_accepted_total"] - before["llorch_jobs_accepted_total"]
        assert accepted == (MAX_CONNECTIONS - 1) * NEVER_READ["n"]
        assert ended_jobs(samples) - ended_jobs(before) == accepted
        cancelled = 'llorch_requests_total{outcome="cancelled"}'
        assert samples.get(cancelled, 0) > before.get(cancelled, 0)  # they were still generating
        assert samples["llorch_running_jobs"] + samples["llorch_queue_depth"] == 0
        assert samples["llorch_kv_cache_bytes"] == 0
        assert real.get("/v1/models").status_code == 200
    assert "left its answer unread" in tiny_worker.log()


def test_past_the_connection_limit_a_new_client_evicts_a_stalled_one(tiny_worker: Worker) -> None:
    """Eight stalled clients hold every request slot; a new client does not wait for the write deadline:
    its connection evicts the one left unread longest, and it is answered."""
    url = tiny_worker.base_url
    stalled = [stalled_request(url, "/v1/completions", NEVER_READ) for _ in range(MAX_CONNECTIONS)]
    sent = time.monotonic()
    try:
        statuses: list[int] = []
        while time.monotonic() - sent < GENERATION_S + WRITE_TIMEOUT_S:
            statuses.append(httpx.get(f"{url}/v1/models", timeout=30).status_code)  # a new connection each
            if statuses[-1] == 200:
                break
            time.sleep(0.5)
        assert statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
        assert 503 in statuses  # the stalled clients held every slot until one was evicted
        assert any(closed_by_peer(c) for c in stalled) and not all(closed_by_peer(c) for c in stalled)
    finally:
        for connection in stalled:
            connection.close()
    assert "left its answer unread longest" in tiny_worker.log()
    samples = settled(tiny_worker, 0, 0)
    assert samples["llorch_running_jobs"] + samples["llorch_queue_depth"] == 0


def read_to_the_end(connection: socket.socket) -> bytes:
    """The whole answer, read now (the worker ends a streamed answer with a zero-length chunk)."""
    connection.settimeout(60)
    data = bytearray()
    while not data.endswith(b"0\r\n\r\n"):
        chunk = connection.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return bytes(data)


def test_a_client_that_stops_reading_holds_its_job_until_it_reads_again(tiny_worker: Worker) -> None:
    """Its job stops decoding once READER_BACKLOG events wait untaken behind the full buffers, instead of
    running on to max_tokens with every event queued in memory; when the client reads again, the job
    resumes and the answer is whole."""
    url = tiny_worker.base_url
    body = {"prompt": "the", "max_tokens": 20000, "logprobs": 5, "ignore_eos": True, "stream": True}
    before = scrape(url)["llorch_generated_tokens_total"]
    connection = stalled_request(url, "/v1/completions", body)
    try:
        generated, still_since = -1.0, time.monotonic()
        while time.monotonic() - still_since < 2:  # until it has not moved for 2 s
            now = scrape(url)["llorch_generated_tokens_total"] - before
            if now != generated:
                generated, still_since = now, time.monotonic()
            time.sleep(0.1)
        assert 0 < generated < body["max_tokens"] / 2, generated  # held, far from max_tokens
        assert scrape(url)["llorch_running_jobs"] == 1  # waiting for its reader, not ended
        answer = read_to_the_end(connection)
    finally:
        connection.close()
    assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
    assert b'"finish_reason":"length"' in answer
    assert scrape(url)["llorch_generated_tokens_total"] - before == body["max_tokens"]
