"""Prometheus metrics of one worker, in a registry of its own (not the process-global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, Info, ProcessCollector

# Seconds; spans a fast GPU token to a slow CPU prefill.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The process's own figures, named as every Prometheus Python client names them: resident memory,
        # CPU seconds, open files; and the garbage collector's work (paused while a worker starts: collector.py).
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter("llorch_requests", "Requests by outcome (an end reason, an error code, "
                                "or a rejection before the job started)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("llorch_prompt_tokens", "Prompt tokens of accepted jobs", registry=r)
        self.generated_tokens = Counter("llorch_generated_tokens", "Tokens generated", registry=r)
        self.time_to_first_token = Histogram(
            "llorch_time_to_first_token_seconds", "From a job's acceptance to its first generated token",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "llorch_time_per_output_token_seconds", "Engine time per generated token after the first",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("llorch_batch_size", "Jobs sharing each forward step",
                                    buckets=(*range(1, 17), 24, 32, 48, 64), registry=r)
        self.accepted = Counter("llorch_jobs_accepted", "Jobs accepted by the engine (each ends with exactly "
                                "one terminal outcome in llorch_requests_total)", registry=r)
        self.queue_depth = Gauge("llorch_queue_depth", "Jobs accepted and waiting for a slot", registry=r)
        self.running = Gauge("llorch_running_jobs", "Jobs being generated", registry=r)
        self.kv_cache_bytes = Gauge("llorch_kv_cache_bytes", "Bytes of KV pool blocks held by jobs", registry=r)
        self.kv_cache_capacity_bytes = Gauge(
            "llorch_kv_cache_capacity_bytes", "Bytes of the KV pool allocated on the device", registry=r)
        self.kv_cached_blocks = Gauge(
            "llorch_kv_cached_blocks", "KV blocks addressable by the prefix cache (held or reusable)", registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "llorch_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache", registry=r)
        self.preemptions = Counter(
            "llorch_preemptions", "Jobs sent back to the queue because the KV pool was full", registry=r)
        self.proposed_tokens = Counter(
            "llorch_speculative_proposed_tokens", "Tokens proposed to decoding rows for verification", registry=r)
        self.accepted_proposals = Counter(
            "llorch_speculative_accepted_tokens", "Proposed tokens verification kept", registry=r)
        self.pooled_inputs = Counter("llorch_pooled_inputs", "Texts embedded and pairs scored, by kind (embed, rerank)",
                                     ["kind"], registry=r)
        self.weights_bytes = Gauge("llorch_weights_bytes", "Bytes of model weights on the device", registry=r)
        self.model = Info("llorch_model", "The served model and device", registry=r)
