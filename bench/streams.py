"""One streamed greedy job on a llorch worker or on llama-server: each token's arrival time, and the text.

A token's arrival is the time of the event that carried it. llorch sends a token event per
piece of text (a piece held back for an unfinished character, or several tokens a step
verified, arrive together; the end event's tokens_out counts them all); llama-server sends
a chunk per step whose text may be empty while a character is unfinished (most of a random
model's), so its tokens are counted from `return_tokens`, not from the content.

The client shares the machine's cores with the server it measures, so it is the leanest
reader the standard library gives: http.client's line reader and orjson take about
0.16 ms of CPU a token where httpx's line iterator took 0.43 ms, which on two cores came
out of the server's step (the same reader for both servers).
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import orjson


@contextmanager
def lines(base_url: str, path: str, body: dict[str, Any], accept: str) -> Iterator[Iterator[bytes]]:
    """POST `body` as JSON on a connection of its own and yield the answer's lines as they arrive.

    A connection of its own: llama-server closes idle kept-alive connections, so a second request
    on a kept-alive connection can find it gone."""
    url = urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=600)
    try:
        connection.request("POST", path, orjson.dumps(body), {"content-type": "application/json", "accept": accept})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{path} answered {response.status}: {response.read()[:500]!r}")
        yield iter(response.readline, b"")
    finally:
        connection.close()


def decode_rate(arrivals: list[float]) -> float:
    """Tokens per second after the first token, from a stream's arrival times (0 when there is no span)."""
    tokens = len(arrivals) - 1
    return (tokens - 1) / (arrivals[-1] - arrivals[1]) if tokens > 1 and arrivals[-1] > arrivals[1] else 0.0


def llorch(base_url: str, prompt: str, max_tokens: int) -> tuple[list[float], str]:
    body = {"job_id": f"bench-{time.monotonic_ns()}", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    arrivals, text = [time.perf_counter()], []
    with lines(base_url, "/execute", body, "application/x-ndjson") as events:
        for line in events:
            event = orjson.loads(line)
            if event["type"] == "token":
                arrivals.append(time.perf_counter())
                text.append(event["t"])
            elif event["type"] == "end":  # tokens that carried no text of their own count at the last arrival
                arrivals.extend([arrivals[-1]] * (event["tokens_out"] - (len(arrivals) - 1)))
            elif event["type"] == "error":
                raise RuntimeError(event["message"])
    return arrivals, "".join(text)


def llama_server(base_url: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> tuple[list[float], str]:
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True, "cache_prompt": False,
            "ignore_eos": ignore_eos, "return_tokens": True}
    arrivals, text = [time.perf_counter()], []
    with lines(base_url, "/completion", body, "text/event-stream") as events:
        for line in events:
            if line.startswith(b"data: "):
                event, now = orjson.loads(line[6:]), time.perf_counter()
                arrivals.extend([now] * len(event.get("tokens") or []))
                text.append(event.get("content", ""))
    return arrivals, "".join(text)
