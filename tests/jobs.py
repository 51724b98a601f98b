"""In-process engine jobs for tests: build an engine, submit a job, collect its events."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from llorch.engine.config import EngineConfig
from llorch.engine.engine import Engine
from llorch.engine.factory import build_engine
from llorch.engine.request import Event, GenerationRequest, SamplingParams
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


def make_engine(loaded: LoadedModel, start: bool = True, **config: Any) -> Engine:
    """An engine over an already loaded model (ctx_size 4096, 256 MB of KV pool unless `config` says)."""
    settings = {"ctx_size": 4096, "kv_cache_bytes": 256 * 2**20, "max_running": 4, **config}
    engine = build_engine(EngineConfig(**settings), loaded=loaded)
    if start:
        engine.start()
    return engine


def with_tokenizer(loaded: LoadedModel, **changes: Any) -> LoadedModel:
    """The same model with some of its tokenizer's fields changed (end-of-generation ids, say)."""
    return dataclasses.replace(loaded, tokenizer=dataclasses.replace(loaded.tokenizer, **changes))


def run(engine: Engine, job_id: str, prompt: str = PROMPT, max_tokens: int = 12,
        sampling: SamplingParams = GREEDY, stop: tuple[str, ...] = ()) -> Job:
    """Submit a job now; wait for it with `.wait()`."""
    job = Job()
    engine.submit(engine.prepare(GenerationRequest(job_id, prompt, max_tokens, sampling, stop)), job.emit)
    return job


def steps_larger_than(engine: Engine, size: int) -> int:
    """How many forward steps batched more than `size` jobs (from the batch-size histogram)."""
    sample = engine.telemetry.registry.get_sample_value
    total = sample("llorch_batch_size_count") or 0
    at_most = sample("llorch_batch_size_bucket", {"le": f"{float(size)}"}) or 0
    return int(total - at_most)
