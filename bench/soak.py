"""Loopback soak: N clients for M seconds against one worker, with cancels, disconnects,
abandoned non-streaming requests and slow clients.

    python bench/soak.py --clients 8 --seconds 600            # starts its own CPU worker
    python bench/soak.py --url http://127.0.0.1:8080 --pid PID --clients 4 --seconds 60

Each client loops: submit a job (random prompt length, max_tokens, sampling), then read
it to the end, or cancel it through /cancel after a few tokens, or drop the connection,
or send a long non-streaming OpenAI request and give up on it after a second or so. One
client in eight is instead a slow one: it opens a connection, sends half a request and
waits for the worker to close it. With `--stalled-readers N`, N more clients each send a
request whose streamed answer is megabytes long (a 4 KiB receive buffer) and never read
a byte of it: the worker must reset each such connection (its write deadline) and end
its jobs. The report gives jobs accepted (by the clients' count
and by the worker's), jobs whose stream carried exactly one terminal event, jobs the
worker counted as ended (must equal those it accepted: disconnected and abandoned ones
included), 503 "busy" answers (expected when clients outnumber --max-running plus
--max-queue), other 5xx answers (must be 0), slow connections the worker closed (all of
them, each within its read deadline), stalled readers the worker reset (all of them),
jobs and KV cache still held afterwards (must be 0), and the worker's RSS after the
first `--warmup` seconds and at the end (the end must be within 10% of it). Traffic goes
to loopback only and stops by itself.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from launch import start_worker, stop
from llorch.api.connections import HEADER_TIMEOUT_S, WRITE_TIMEOUT_S

REPLICA_LABEL = re.compile(r'\{replica="[^"]*",?')  # the label the Ray Serve front adds

# A stalled reader's answer is generated before it can stall (megabytes must be sent first): this long
# is allowed for that, on top of the write deadline.
STALL_GENERATION_S = 180.0
TCP_CLOSED_STATES = (7, 8)  # Linux TCP_CLOSE (reset), TCP_CLOSE_WAIT (the peer's FIN)

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
    "seven", "wizards", "quietly", "judge", "boxing", "and", "every", "kettle", "hums",
)


@dataclass
class SoakReport:
    clients: int
    seconds: float
    accepted: int = 0  # streams the clients saw accepted
    completed: int = 0  # read to the end
    cancelled: int = 0  # cancelled through /cancel, then read to the end
    disconnected: int = 0  # dropped by the client mid-stream
    abandoned: int = 0  # non-streaming requests the client gave up on before the answer
    unary_answered: int = 0  # non-streaming requests answered before the client gave up
    slow_connections: int = 0  # half-sent requests by slow clients
    slow_closed_in_time: int = 0  # ... that the worker closed within its read deadline
    stalled_readers: int = 0  # requests whose long answer the client never read
    stalled_reset: int = 0  # ... whose connection the worker closed (its write deadline)
    accepted_by_worker: int = 0  # jobs the worker accepted during the soak
    exactly_one_terminal: int = 0  # among streams read to the end
    rejected_4xx: int = 0
    busy_503: int = 0  # queue full: answered at once with Retry-After
    server_errors_5xx: int = 0
    ended_by_worker: int = 0  # terminal outcomes the worker counted during the soak
    in_flight_after: int = -1
    kv_bytes_after: int = -1
    rss_start_mb: float = 0.0
    rss_warm_mb: float = 0.0  # after the warm-up
    rss_end_mb: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        read_to_end = self.completed + self.cancelled
        return (self.server_errors_5xx == 0 and self.exactly_one_terminal == read_to_end
                and self.ended_by_worker == self.accepted_by_worker and self.accepted_by_worker >= self.accepted
                and self.in_flight_after == 0 and self.kv_bytes_after == 0
                and self.slow_closed_in_time == self.slow_connections
                and self.stalled_reset == self.stalled_readers and not self.problems)

    @property
    def rss_steady(self) -> bool:
        """The worker's memory at the end is within 10% of what it held after the warm-up (no leak)."""
        return self.rss_end_mb <= 1.1 * self.rss_warm_mb


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (VmRSS), or its peak so far with field="VmHWM"."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def scrape(url: str) -> dict[str, float]:
    """The worker's Prometheus samples, by name with labels (llorch-ray-serve's replicas summed)."""
    samples: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = REPLICA_LABEL.sub("{", name).replace("{}", "")
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def ended_jobs(samples: dict[str, float]) -> int:
    """Jobs that reached a terminal event (an end reason or an error), not rejections."""
    return int(sum(value for name, value in samples.items()
                   if name.startswith("llorch_requests_total{") and 'outcome="rejected_' not in name))


def address(url: str) -> tuple[str, int]:
    """(host, port) of an http://host:port URL."""
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def raw_exchange(url: str, request: bytes, timeout: float = 30) -> bytes:
    """Send `request` as it is and read until the server closes the connection."""
    with socket.create_connection(address(url), timeout=timeout) as connection:
        connection.sendall(request)
        answer = bytearray()
        while chunk := connection.recv(1 << 16):
            answer += chunk
    return bytes(answer)


def slow_client_loop(url: str, running: Callable[[], bool], report: SoakReport, lock: threading.Lock) -> None:
    """Half a request, then silence, until the worker closes the connection (its read deadline)."""
    while running():
        with socket.create_connection(address(url)) as connection:
            connection.sendall(b"POST /execute HTTP/1.1\r\nHost: soak\r\nContent-Length: 64\r\n")
            opened = time.monotonic()
            closed = closed_within(connection, HEADER_TIMEOUT_S + 5)
            with lock:
                report.slow_connections += 1
                report.slow_closed_in_time += closed and time.monotonic() - opened < HEADER_TIMEOUT_S + 5


def stalled_request(url: str, path: str, body: dict[str, object]) -> socket.socket:
    """A connection that sends `body` to `path` and then never reads: its 4 KiB receive buffer is full at once."""
    host, port = address(url)
    connection = socket.socket()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: it sets the window
    connection.connect((host, port))
    payload = json.dumps(body).encode()
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return connection


def closed_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the server closes (or resets) the connection within `seconds` (reading at most one byte)."""
    connection.settimeout(max(seconds, 0.01))
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def closed_by_peer(connection: socket.socket) -> bool:
    """Whether the other side has reset or closed the connection, seen without reading a byte of it (Linux)."""
    return connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in TCP_CLOSED_STATES


def stalled_reader_loop(url: str, running: Callable[[], bool], report: SoakReport, lock: threading.Lock) -> None:
    """Eight streamed choices of 512 tokens with 20 alternatives each (megabytes), never read, until the
    worker resets the connection."""
    body = {"prompt": " ".join(WORDS), "max_tokens": 512, "n": 8, "logprobs": 20, "ignore_eos": True,
            "stream": True}
    while running():
        with stalled_request(url, "/v1/completions", body) as connection:
            give_up = time.monotonic() + STALL_GENERATION_S + WRITE_TIMEOUT_S
            while not closed_by_peer(connection) and time.monotonic() < give_up:
                time.sleep(0.5)
            with lock:
                report.stalled_readers += 1
                report.stalled_reset += closed_by_peer(connection)


def abandon_unary(http: httpx.Client, model: str, rng: random.Random, report: SoakReport,
                  lock: threading.Lock) -> None:
    """A long non-streaming OpenAI request the client stops waiting for: the worker must cancel its job."""
    body = {"model": model, "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 50))),
            "max_tokens": rng.randint(200, 2000), "temperature": 0.7}
    try:
        response = http.post("/v1/completions", json=body, timeout=rng.uniform(0.3, 2.0))
    except httpx.TimeoutException:
        with lock:
            report.abandoned += 1
        return
    with lock:
        if response.status_code == 503 and response.headers.get("retry-after"):
            report.busy_503 += 1
        elif response.status_code >= 500:
            report.server_errors_5xx += 1
        else:
            report.unary_answered += 1


def client_loop(url: str, index: int, running: Callable[[], bool], report: SoakReport, lock: threading.Lock) -> None:
    rng = random.Random(index)
    with httpx.Client(base_url=url, timeout=120) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        n = 0
        while running():
            n += 1
            job_id = f"soak-{index}-{n}"
            body = {"job_id": job_id, "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 200))),
                    "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0.0, 0.7, 1.0]),
                    "seed": rng.randint(0, 2**32)}
            action = rng.choices(["complete", "cancel", "disconnect", "abandon"], weights=[6, 2, 2, 1])[0]
            if action == "abandon":
                abandon_unary(http, model, rng, report, lock)
                continue
            terminals, seen_tokens = 0, 0
            with http.stream("POST", "/execute", json=body) as response:
                if response.status_code == 503 and response.headers.get("retry-after"):
                    with lock:
                        report.busy_503 += 1
                    time.sleep(rng.uniform(0.05, 0.2))
                    continue
                if response.status_code >= 500:
                    with lock:
                        report.server_errors_5xx += 1
                    continue
                if response.status_code != 200:
                    with lock:
                        report.rejected_4xx += 1
                    continue
                with lock:
                    report.accepted += 1
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event["type"] == "token":
                        seen_tokens += 1
                        if action == "cancel" and seen_tokens == 2:
                            http.post("/cancel", json={"job_id": job_id})
                        if action == "disconnect" and seen_tokens == 2:
                            break
                    if event["type"] in ("end", "error"):
                        terminals += 1
            with lock:
                if action == "disconnect" and seen_tokens >= 2:
                    report.disconnected += 1
                else:
                    report.completed += action != "cancel"
                    report.cancelled += action == "cancel"
                    report.exactly_one_terminal += terminals == 1
                    if terminals != 1:
                        report.problems.append(f"{job_id}: {terminals} terminal events")


class Running:
    """Whether the clients go on: for `seconds`; then, given `enough`, until the report has what it asks
    for or `longest` seconds have passed. Why: a test asks for every kind of event (so many jobs,
    a disconnect, a cancel), and a loaded machine serves fewer jobs a second than a quiet one."""

    def __init__(self, report: SoakReport, lock: threading.Lock, seconds: float,
                 enough: Callable[[SoakReport], bool] | None, longest: float) -> None:
        self.report, self.lock, self.seconds, self.enough, self.longest = report, lock, seconds, enough, longest
        self.started = time.monotonic()

    def __call__(self) -> bool:
        elapsed = time.monotonic() - self.started
        if elapsed < self.seconds:
            return True
        if self.enough is None or elapsed >= self.longest:
            return False
        with self.lock:
            return not self.enough(self.report)


def soak(url: str, pid: int, clients: int, seconds: float, warmup: float = 0.0, stalled_readers: int = 0,
         enough: Callable[[SoakReport], bool] | None = None, longest: float = 0.0) -> SoakReport:
    report = SoakReport(clients=clients, seconds=seconds, rss_start_mb=rss_mb(pid))
    before = scrape(url)
    ended_before, accepted_before = ended_jobs(before), before.get("llorch_jobs_accepted_total", 0)
    lock = threading.Lock()
    running = Running(report, lock, seconds, enough, longest)
    started = running.started
    threads = [threading.Thread(target=slow_client_loop, args=(url, running, report, lock)) if i % 8 == 7 else
               threading.Thread(target=client_loop, args=(url, i, running, report, lock)) for i in range(clients)]
    threads += [threading.Thread(target=stalled_reader_loop, args=(url, running, report, lock))
                for _ in range(stalled_readers)]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, min(warmup, seconds) - (time.monotonic() - started)))
    report.rss_warm_mb = rss_mb(pid)
    for thread in threads:
        thread.join()
    # Every job must be gone: no KV cache left behind by a cancel or a disconnect.
    settle = time.monotonic() + 10
    while time.monotonic() < settle:
        health = httpx.get(f"{url}/health").json()
        samples = scrape(url)
        report.in_flight_after = int(samples["llorch_running_jobs"] + samples["llorch_queue_depth"])
        report.kv_bytes_after = int(samples["llorch_kv_cache_bytes"])
        report.ended_by_worker = ended_jobs(samples) - ended_before
        report.accepted_by_worker = int(samples.get("llorch_jobs_accepted_total", 0) - accepted_before)
        if (report.in_flight_after == 0 and health["status"] == "healthy"
                and report.ended_by_worker >= report.accepted_by_worker):
            break
        time.sleep(0.1)
    report.rss_end_mb = rss_mb(pid)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url")
    parser.add_argument("--pid", type=int)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--stalled-readers", type=int, default=0,
                        help="clients that never read their (long) answers; the worker must reset them")
    parser.add_argument("--warmup", type=float, default=120,
                        help="seconds after which the RSS baseline is taken (default 120)")
    args = parser.parse_args()
    server = None
    url, pid = args.url, args.pid
    if url is None:
        server = start_worker(None)
        url, pid = server.base_url, server.process.pid
    try:
        report = soak(url, pid, args.clients, args.seconds, args.warmup, args.stalled_readers)
    finally:
        if server is not None:
            stop(server)
    print(json.dumps({**asdict(report), "ok": report.ok, "rss_steady": report.rss_steady}, indent=2))
    sys.exit(0 if report.ok and report.rss_steady else 1)


if __name__ == "__main__":
    main()
