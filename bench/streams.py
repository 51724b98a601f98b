"""One streamed greedy job on a llorch worker or on llama-server: each token's arrival time, and the text.

A token's arrival is the time of the event that carried it. llorch sends a token event per
piece of text (a piece held back for an unfinished character, or several tokens a step
verified, arrive together; the end event's tokens_out counts them all); llama-server sends
a chunk per step whose text may be empty while a character is unfinished (most of a random
model's), so its tokens are counted from `return_tokens`, not from the content.
"""

from __future__ import annotations

import json
import time

import httpx


def llorch(base_url: str, prompt: str, max_tokens: int) -> tuple[list[float], str]:
    body = {"job_id": f"bench-{time.monotonic_ns()}", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    arrivals, text = [time.perf_counter()], []
    with httpx.stream("POST", f"{base_url}/execute", json=body, headers={"accept": "application/x-ndjson"},
                      timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            event = json.loads(line)
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
    # A connection of its own: llama-server closes idle kept-alive connections, so a second
    # request on a kept-alive connection can find it gone ("Server disconnected").
    with httpx.stream("POST", f"{base_url}/completion", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: "):
                event, now = json.loads(line[6:]), time.perf_counter()
                arrivals.extend([now] * len(event.get("tokens") or []))
                text.append(event.get("content", ""))
    return arrivals, "".join(text)
