"""The engine core of an encoder (embedding or rerank) model: each step reads whole texts and pools them.

An encoder attends in both directions, so a text cannot be read in chunks and keeps no cache
between steps: a job is admitted, computed and finished in one step. Each step takes the
waiting jobs in arrival order while they fit its rows and its tokens, runs them as one packed
batch, and reports one pooled vector (or score) per job. It offers the shell the same calls as
the generating core (core.py), so the shell's thread, admission, cancellation and timeouts are
the same for every kind of job.

A failing batch is retried job by job, so only the job that fails ends.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from llorch.device import resident_module_bytes
from llorch.engine.plan import StepOutput
from llorch.engine.request import ErrorCode
from llorch.engine.sequence import Sequence, SequenceState
from llorch.engine.telemetry import Telemetry
from llorch.engine.views import EngineStats
from llorch.models.encoder import Encoder

log = logging.getLogger("llorch.engine")


class EncoderRunner:
    """The encoder on its device: packed texts in, one row per text out (the values leave the device here)."""

    def __init__(self, model: Encoder, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.config = model.config
        self.device = device
        self.dtype = dtype
        self.weight_bytes = resident_module_bytes(device, model)
        self.prompt_kernel = False  # every row is an input's own (ModelRunner.prompt_kernel): one kernel for all

    @property
    def resident_bytes(self) -> int:
        return self.weight_bytes  # no cache: activations live for one step

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> list[tuple[float, ...]]:
        ids = [t for seq in seqs for t in seq.prompt_ids]
        types = [t for seq in seqs for t in seq.type_ids]
        pooled = self.model(torch.tensor(ids, device=self.device), torch.tensor(types, device=self.device),
                            [len(seq.prompt_ids) for seq in seqs])
        return [tuple(row) for row in pooled.float().cpu().tolist()]


class EncoderCore:
    block_size = 1  # no KV blocks: a Sequence's block table stays empty

    def __init__(self, runner: EncoderRunner, max_rows: int, max_batch_tokens: int, telemetry: Telemetry) -> None:
        self.runner = runner
        self.max_rows = max_rows
        self.max_batch_tokens = max_batch_tokens
        self.telemetry = telemetry
        self.waiting: deque[Sequence] = deque()
        t = telemetry
        t.queue_depth.set_function(lambda: len(self.waiting))
        t.running.set_function(lambda: 0)
        t.weights_bytes.set_function(lambda: runner.weight_bytes)

    @property
    def idle(self) -> bool:
        return not self.waiting

    @property
    def resident_bytes(self) -> int:
        return self.runner.resident_bytes

    def sequences(self) -> list[Sequence]:
        return list(self.waiting)

    def find(self, job_id: str) -> Sequence | None:
        return next((seq for seq in self.waiting if seq.job_id == job_id), None)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq.state is SequenceState.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.state = SequenceState.FINISHED

    def stats(self, jobs_in_flight: int) -> EngineStats:
        counter = self.telemetry.registry.get_sample_value
        return EngineStats(jobs_in_flight=jobs_in_flight, waiting=len(self.waiting), running=0, kv_blocks_used=0,
                           kv_blocks_cached=0, kv_bytes_used=0, kv_bytes_capacity=0,
                           weights_bytes=self.runner.weight_bytes, prefix_cache_hit_tokens=0, preemptions=0,
                           generated_tokens=int(counter("llorch_generated_tokens_total") or 0), grammar_states=0)

    def step(self) -> StepOutput:
        """Admit the jobs that fit one batch, compute them, report each one's pooled values."""
        out = StepOutput(ran=True)
        batch = self._admit()
        now = time.perf_counter()
        for seq in batch:
            seq.state, seq.admitted_at = SequenceState.RUNNING, now
            out.admitted.append(seq)
        self.telemetry.batch_size.observe(len(batch))
        try:
            values = self.runner.forward(batch)
        except Exception:  # find the job that fails, so only it ends
            values = [self._alone(seq, out) for seq in batch]
        for seq, pooled in zip(batch, values, strict=True):
            if pooled is not None:
                seq.state = SequenceState.FINISHED
                out.pooled.append((seq, pooled))
        return out

    def _admit(self) -> list[Sequence]:
        """Waiting jobs in arrival order while the batch's tokens stay within the budget (the first always goes:
        the front door keeps every text within the model's context)."""
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_rows:
            tokens += len(self.waiting[0].prompt_ids)
            if batch and tokens > self.max_batch_tokens:
                break
            batch.append(self.waiting.popleft())
        return batch

    def _alone(self, seq: Sequence, out: StepOutput) -> tuple[float, ...] | None:
        try:
            return self.runner.forward([seq])[0]
        except Exception as exc:
            log.error("step failed", exc_info=exc, extra={"job_id": seq.job_id})
            code = ErrorCode.VRAM_OOM if isinstance(exc, torch.OutOfMemoryError) else ErrorCode.INFERENCE_FAILED
            seq.state = SequenceState.FINISHED
            out.failed.append((seq, code, f"{type(exc).__name__}: {exc}"))
            return None
