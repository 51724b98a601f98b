"""Streams the engine thread writes to the socket itself (api/socket_body.py, api/jobs.py).

A real server (uvicorn with the worker's protocol, on a socket) streams a scripted job's events
as the worker API frames them: a client that reads gets every event once and in order, written
by the engine's thread; a client that stops reading gets the rest, in order, through the event
loop once it reads again, and meanwhile its job is held as any slow reader's; a client that goes
away cancels its job.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from llorch.api import socket_body as socket_body_module
from llorch.api.connections import guarded_protocol
from llorch.api.jobs import JobStream
from llorch.api.socket_body import socket_body
from llorch.api.streaming import NDJSON, frame
from llorch.engine.request import End, Event, Started, StopReason, TokenText

pytestmark = pytest.mark.cpu


class ScriptedEngine:
    """Emits a fixed list of events from its own thread, as the engine does, `pause_s` apart."""

    def __init__(self, events: list[Event], pause_s: float = 0.0) -> None:
        self.events, self.pause_s = events, pause_s
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.backlogs: list[int] = []

    def submit(self, job: Any, emit: Callable[[Event], None], backlog: Callable[[], int]) -> None:
        def run() -> None:
            for event in self.events:
                if self.cancelled.is_set():
                    break
                emit(event)
                self.backlogs.append(backlog())
                time.sleep(self.pause_s)
            self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def cancel(self, job_id: str) -> bool:
        self.cancelled.set()
        return True


def script(tokens: int, text: Callable[[int], str]) -> list[Event]:
    return [Started("job", "scripted", "now"), *(TokenText(text(i), i) for i in range(tokens)),
            End(tokens, 1.0, StopReason.MAX_TOKENS)]


class Served:
    def __init__(self) -> None:
        self.engine: ScriptedEngine | None = None

    async def execute(self, request: Request) -> StreamingResponse:
        assert self.engine is not None
        stream = JobStream(self.engine, SimpleNamespace(request=SimpleNamespace(job_id="job")))  # type: ignore[arg-type]

        return StreamingResponse(stream.frames(lambda event: frame(NDJSON, event.to_dict()), socket_body(request)),
                                 media_type=NDJSON)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Served, int]]:
    served = Served()
    app = Starlette(routes=[Route("/execute", served.execute, methods=["POST"])])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = uvicorn.Config(app, http=guarded_protocol(8), log_config=None, access_log=False)
    live = uvicorn.Server(config)
    thread = threading.Thread(target=live.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    give_up = time.monotonic() + 30
    while not live.started and time.monotonic() < give_up:
        time.sleep(0.05)
    assert live.started
    yield served, port
    live.should_exit = True
    thread.join(10)
    listener.close()


@pytest.fixture()
def direct_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many chunks the engine's thread wrote and the socket took whole."""
    taken: list[int] = []
    write = socket_body_module.SocketBody.write

    def counted(self: socket_body_module.SocketBody, data: bytes) -> bytes | None:
        rest = write(self, data)
        if rest is None:
            taken.append(len(data))
        return rest

    monkeypatch.setattr(socket_body_module.SocketBody, "write", counted)
    return taken


def events_of(lines: Iterator[bytes]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if line.strip()]


def expected(events: list[Event]) -> list[dict[str, Any]]:
    return [json.loads(json.dumps(event.to_dict())) for event in events]


def test_a_reading_client_gets_every_event_in_order_from_the_engine_thread(
        server: tuple[Served, int], direct_writes: list[int]) -> None:
    served, port = server
    events = script(300, lambda i: ["a", " ü", "\n", "汉字", '"q"'][i % 5] + str(i))
    served.engine = ScriptedEngine(events, pause_s=0.002)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/execute", b"{}", {"accept": NDJSON})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("transfer-encoding") == "chunked"
        received = events_of(iter(response.readline, b""))
    finally:
        connection.close()
    assert received == expected(events)
    # Every token the engine emitted once the reader was waiting went out from its thread; the loop
    # carried the first event and the end.
    assert len(direct_writes) >= 290


def test_a_client_that_stops_reading_gets_the_rest_in_order_and_holds_its_job(
        server: tuple[Served, int], direct_writes: list[int]) -> None:
    served, port = server
    events = script(400, lambda i: f"{i:05d}" + "x" * 8000)  # 3.2 MB: more than every buffer on the way
    engine = served.engine = ScriptedEngine(events)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    try:
        client.sendall(b"POST /execute HTTP/1.1\r\nhost: x\r\naccept: application/x-ndjson\r\n"
                       b"content-length: 2\r\n\r\n{}")
        give_up = time.monotonic() + 20
        while not (engine.backlogs and max(engine.backlogs) > 16) and time.monotonic() < give_up:
            time.sleep(0.05)
        # The socket filled up: what is left is the loop's to send, counted as the reader's backlog, which is
        # what holds a job whose client does not read (the engine's READER_BACKLOG).
        assert max(engine.backlogs) > 16
        client.settimeout(30)
        data = bytearray()
        while not data.endswith(b"0\r\n\r\n"):
            chunk = client.recv(1 << 16)
            assert chunk, "the server closed the connection before the answer ended"
            data += chunk
    finally:
        client.close()
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    assert events_of(iter(dechunked(body).splitlines())) == expected(events)
    assert direct_writes  # the engine's thread wrote until the socket was full


def dechunked(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body's bytes (RFC 9112, section 7.1), checking its framing on the way."""
    out, at = bytearray(), 0
    while True:
        line_end = body.index(b"\r\n", at)
        size = int(body[at:line_end], 16)
        start = line_end + 2
        if size == 0:
            assert body[start:] == b"\r\n"
            return bytes(out)
        out += body[start : start + size]
        assert body[start + size : start + size + 2] == b"\r\n"
        at = start + size + 2


def test_a_client_that_goes_away_mid_stream_cancels_its_job(
        server: tuple[Served, int], direct_writes: list[int]) -> None:
    served, port = server
    engine = served.engine = ScriptedEngine(script(100_000, str), pause_s=0.001)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", "/execute", b"{}", {"accept": NDJSON})
    response = connection.getresponse()
    for _ in range(50):
        response.readline()
    give_up = time.monotonic() + 5
    while len(direct_writes) < 20 and time.monotonic() < give_up:  # the engine's thread is writing
        time.sleep(0.01)
    assert len(direct_writes) >= 20
    connection.close()
    assert engine.cancelled.wait(10)
    assert engine.done.wait(10) and len(engine.backlogs) < 100_000


def test_an_http_1_0_client_is_answered_through_the_event_loop(
        server: tuple[Served, int], direct_writes: list[int]) -> None:
    """HTTP/1.0 has no chunks: its answer ends when the connection closes, as the loop frames it."""
    served, port = server
    events = script(50, str)
    served.engine = ScriptedEngine(events, pause_s=0.002)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(b"POST /execute HTTP/1.0\r\naccept: application/x-ndjson\r\ncontent-length: 2\r\n\r\n{}")
        data = bytearray()
        while chunk := client.recv(1 << 16):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    assert events_of(iter(body.splitlines())) == expected(events)
    assert direct_writes == []
