"""In-process engine jobs for tests: build an engine, submit a job, collect its events."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from llorch.engine.engine import Engine
from llorch.engine.request import Event, GenerationRequest, SamplingParams
from llorch.engine.runner import ModelRunner
from llorch.weights.loader import LoadedModel

GREEDY = SamplingParams(temperature=0.0)
PROMPT = "The capital of France is"


class Job:
    """Collects one job's events as their wire dicts; `done` is set by the terminal event."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.done = threading.Event()

    def emit(self, event: Event) -> None:
        self.events.append(event.to_dict())
        if event.terminal:
            self.done.set()

    def wait(self, timeout: float = 120) -> dict[str, Any]:
        assert self.done.wait(timeout), "job never ended"
        return self.events[-1]

    @property
    def text(self) -> str:
        return "".join(e["t"] for e in self.events if e["type"] == "token")

    @property
    def terminal_events(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] in ("end", "error")]


def make_engine(loaded: LoadedModel, max_running: int = 4, request_timeout: float | None = None,
                kv_cache_mb: float = 256, engine_options: dict[str, Any] | None = None,
                **tokenizer_changes: Any) -> Engine:
    runner = ModelRunner(loaded.model, torch.device("cpu"), loaded.dtype, kv_cache_bytes=int(kv_cache_mb * 2**20))
    tokenizer = dataclasses.replace(loaded.tokenizer, **tokenizer_changes)
    engine = Engine(runner, tokenizer, loaded.name, ctx_size=4096, max_running=max_running,
                    request_timeout=request_timeout, **(engine_options or {}))
    engine.start()
    return engine


def run(engine: Engine, job_id: str, prompt: str = PROMPT, max_tokens: int = 12,
        sampling: SamplingParams = GREEDY, stop: tuple[str, ...] = ()) -> Job:
    """Submit a job now; wait for it with `.wait()`."""
    job = Job()
    request = GenerationRequest(job_id, prompt, max_tokens, sampling, stop)
    engine.submit(request, engine.prepare(request), job.emit)
    return job
