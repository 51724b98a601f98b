"""What the engine shows of itself: read-only snapshots for health checks, listings, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of what the engine holds and has done (for health checks, tests and benchmarks)."""

    jobs_in_flight: int  # accepted and not yet ended
    waiting: int  # in the queue (never admitted, or preempted)
    running: int
    kv_blocks_used: int  # held by jobs
    kv_blocks_cached: int  # addressable by the prefix cache (held or reusable)
    kv_bytes_used: int
    kv_bytes_capacity: int
    weights_bytes: int
    prefix_cache_hit_tokens: int
    preemptions: int
    generated_tokens: int
    grammar_states: int  # constrained jobs holding a grammar matcher (queued or running)


@dataclass(frozen=True)
class JobView:
    """One job in flight, as listings show it (llama-server's /slots): read without stopping the engine."""

    job_id: str
    state: str  # "waiting" (never admitted, or preempted) or "running"
    prompt_tokens: int
    generated_tokens: int
    prompt: str | None  # the prompt text as sent (None: token ids or chat messages)


@dataclass(frozen=True)
class EmbeddingShape:
    """What an embedding model's vectors are: their length, whether of unit length, and the shorter lengths the
    model was trained to be cut to (Matryoshka)."""

    dimensions: int
    normalized: bool
    matryoshka: tuple[int, ...] = ()
