"""The engine's shell: the one thread that owns the model, its inbox, and every job's lifecycle.

    prepare (front door) -> submit -> inbox -> each turn: core.step() -> output stage

The synchronous core (core.py) computes a step and reports what it did to each job;
the output stage (output.py) turns that into text and events. The shell owns what
has a thread or a clock: submit and cancel, admission counting, timeouts, and
keeping each failure to its job (an output stage that fails ends only that job; a
loop that dies ends every job and refuses new ones).

The HTTP side calls `prepare`, `submit`, `cancel` and the read-only views, and gets plain
events through the callback it passed; it never touches a tensor. Every state change of a
job (accepted, admitted, preempted, finished or failed) is logged once with its job_id.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from llorch.engine.core import EngineCore
from llorch.engine.errors import DuplicateJob, QueueFull
from llorch.engine.output import OutputProcessor
from llorch.engine.plan import StepOutput
from llorch.engine.prepare import FrontDoor
from llorch.engine.request import ErrorCode, Event, GenerationRequest, PreparedJob, StopReason
from llorch.engine.sequence import Sequence, SequenceState
from llorch.engine.telemetry import Telemetry
from llorch.engine.tokens import TokenFacts
from llorch.engine.views import EmbeddingShape, EngineStats, JobView
from llorch.models.config import ModelConfig
from llorch.models.encoder_config import EncoderConfig
from llorch.weights.chat_template import ChatTemplate
from llorch.weights.model_facts import ModelFacts, facts_or_unknown
from llorch.weights.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llorch.engine.config import EngineConfig
    from llorch.engine.encoder_core import EncoderCore

log = logging.getLogger("llorch.engine")

HELD_POLL_S = 0.005  # how often a loop whose every running job waits for its reader looks again


class Engine:
    """The shell around a core: the generating core (core.py) or an encoder's (encoder_core.py), assembled by
    the factory with the front door that prepares its jobs."""

    def __init__(self, core: EngineCore | EncoderCore, front: FrontDoor, tokenizer: Tokenizer, config: EngineConfig,
                 *, model_name: str, model_id: str, telemetry: Telemetry, model_path: Path | None = None,
                 embedding: EmbeddingShape | None = None) -> None:
        assert config.ctx_size is not None and config.max_running is not None, "build_engine resolves the limits"
        self.core = core
        self.runner = core.runner
        self.model_path = model_path  # the served file or directory (None: built from a model already loaded)
        self._facts: ModelFacts | None = None
        self.config = config
        self.model_name = model_name
        self.model_id = model_id
        self.kind = front.kind  # "generate", "embed" or "rerank"
        self.embedding = embedding  # an embedding model's vectors
        self.ctx_size = config.ctx_size
        self.device = str(core.runner.device or "cpu")  # "cpu", "cuda:0", ...: the C step runs on the CPU
        self.tokens = TokenFacts(tokenizer)  # the tokenizer as the API layers may see it
        self.front = front
        self.telemetry = telemetry
        self.output = OutputProcessor(tokenizer, model_name, self.telemetry, lambda: self.resident_bytes)
        self._queued = 0  # accepted jobs never admitted yet (guarded by _jobs_lock)
        self._arrivals = 0
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._jobs: dict[str, Sequence] = {}
        self._jobs_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="llorch-engine", daemon=True)
        self._stopping = threading.Event()
        self.failed: BaseException | None = None

    # -- the front door (called from the HTTP side) ---------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failed is None

    @property
    def resident_bytes(self) -> int:
        """Bytes the weights and the KV pool hold on the device (the contract's vram_bytes), a draft model's too."""
        return self.core.resident_bytes

    @property
    def model_config(self) -> ModelConfig | EncoderConfig:
        """The model's shapes and switches (a fact for listings; nothing to change)."""
        return self.runner.config

    def model_facts(self) -> ModelFacts:
        """The model file's facts for listings, read once (it hashes the file unless a load already did)."""
        if self._facts is None:
            self._facts = facts_or_unknown(self.model_path, self.runner.parameter_count, self.runner.weight_bytes)
        return self._facts

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self.front.chat_template

    def prepare(self, request: GenerationRequest) -> PreparedJob:
        """Render, tokenize and size a request (raises RequestRejected naming the field)."""
        return self.front.prepare(request)

    def submit(self, job: PreparedJob, emit: Callable[[Event], None],
               backlog: Callable[[], int] | None = None) -> None:
        """Accept a job. Its events, starting with `started`, go to `emit` from the engine thread;
        `backlog` says how many of them its reader has not taken yet (see scheduler.READER_BACKLOG).

        Raises DuplicateJob for a job_id in flight, QueueFull when `max_queue` jobs already wait.
        """
        request = job.request
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(64)
        with self._jobs_lock:
            if self.failed is not None:  # nothing would ever run it
                raise QueueFull(f"the engine has stopped ({type(self.failed).__name__}); the worker is unhealthy")
            if request.job_id in self._jobs:
                raise DuplicateJob(request.job_id)
            # Jobs not yet admitted take the free slots first: only those beyond them wait. (Counting
            # every unadmitted job refused bursts that arrive faster than the loop admits them.)
            free_slots = max(0, self.config.max_running - (len(self._jobs) - self._queued))
            waiting = max(0, self._queued - free_slots)
            if waiting >= self.config.max_queue:
                raise QueueFull(f"{waiting} jobs are already waiting (--max-queue {self.config.max_queue})")
            self._queued += 1
            self._arrivals += 1
            seq = Sequence(job, seed, self._arrivals, self.core.block_size, self.core.runner.prompt_kernel)
            seq.backlog = backlog
            self.output.open(request.job_id, request.stop, emit)
            self._jobs[request.job_id] = seq
        self.telemetry.accepted.inc()
        self._inbox.put(("submit", seq))

    def cancel(self, job_id: str) -> bool:
        """Ask a queued or running job to stop; False when no such job is in flight."""
        with self._jobs_lock:
            if job_id not in self._jobs:
                return False
        self._inbox.put(("cancel", job_id))
        return True

    def abort_all(self, message: str) -> None:
        """End every queued and running job with a CANCELLED error (used when shutting down)."""
        self._inbox.put(("abort", message))

    @property
    def jobs_in_flight(self) -> int:
        with self._jobs_lock:
            return len(self._jobs)

    def job_views(self) -> list[JobView]:
        """Every accepted job not yet ended, oldest first (a racy read of counts: for display only)."""
        with self._jobs_lock:
            seqs = sorted(self._jobs.values(), key=lambda seq: seq.arrival)
        return [JobView(seq.job_id, "running" if seq.state is SequenceState.RUNNING else "waiting",
                        len(seq.prompt_ids), len(seq.output_ids), seq.request.prompt) for seq in seqs]

    def stats(self) -> EngineStats:
        return self.core.stats(self.jobs_in_flight)

    # -- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=self.core.idle)
                if not self.core.idle:
                    self._end_timed_out()
                    out = self.core.step()
                    self._report(out)
                    if not out.ran:  # every running job waits for its reader: poll, do not spin
                        self._drain_inbox(block=True, timeout=HELD_POLL_S)
        except BaseException as exc:  # the loop itself must never die silently
            with self._jobs_lock:
                self.failed = exc
                stranded = list(self._jobs.values())
            log.exception("engine loop failed; the worker is unhealthy")
            why = f"the engine stopped: {type(exc).__name__}: {exc}"
            for seq in stranded:  # every accepted job still gets its one terminal event
                try:
                    self._fail(seq, ErrorCode.INFERENCE_FAILED, why)
                except Exception:  # not in the scheduler yet (still in the inbox): only its event
                    self._ended(seq)
                    self.output.fail(seq, ErrorCode.INFERENCE_FAILED, why)

    def _drain_inbox(self, block: bool, timeout: float = 0.5) -> None:
        while True:
            try:
                kind, payload = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                assert isinstance(payload, Sequence)
                self._accepted(payload)
            elif kind == "cancel":
                seq = self.core.find(str(payload))
                if seq is not None:
                    log.info("cancel requested", extra={"job_id": seq.job_id, "state": seq.state.value})
                    self._finish(seq, StopReason.CANCELLED)  # between steps: its blocks are free at once
            elif kind == "abort":
                for seq in self.core.sequences():
                    self._fail(seq, ErrorCode.CANCELLED, str(payload))

    def _report(self, out: StepOutput) -> None:
        """A step's results through the output stage, in event order; a job whose output fails ends alone."""
        for seq in out.admitted:
            with self._jobs_lock:
                self._queued -= 1
            self._guarded(seq, self.output.decoding, seq)
            log.info("job admitted", extra={"job_id": seq.job_id, "prefix_cached_tokens": seq.blocks.computed})
        for seq, start, scores in out.scores:
            self._guarded(seq, self.output.prompt_scored, seq, start, scores)
        for row in out.rows:
            matched = self._guarded(row.seq, self.output.tokens, row.seq, row.sampled, row.accepted)
            if matched:
                self._finish(row.seq, StopReason.STOP_SEQUENCE)
            elif row.reason is not None and self._live(row.seq):
                self._ended(row.seq)
                self.output.finish(row.seq, row.reason)
        for seq, values in out.pooled:
            self._guarded(seq, self.output.pooled, seq, values)  # its terminal event, unless that fails it
            if self._live(seq):
                self._ended(seq)
        for seq, reason in out.finished:
            if self._live(seq):
                self._ended(seq)
                self.output.finish(seq, reason)
        for seq, code, message in out.failed:
            if self._live(seq):
                self._ended(seq)
                self.output.fail(seq, code, message)

    def _guarded(self, seq: Sequence, stage: Callable[..., bool | None], *args: object) -> bool | None:
        """Run one output-stage call for a job still in flight; a failure ends that job with an error."""
        if not self._live(seq):
            return None
        try:
            return stage(*args)
        except Exception as exc:  # one job's failure must not take down the others
            log.exception("output failed", extra={"job_id": seq.job_id})
            self._fail(seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}")
            return None

    def _live(self, seq: Sequence) -> bool:
        """The job has not ended (its id may since name a new job: the object decides)."""
        return self._jobs.get(seq.job_id) is seq

    def _end_timed_out(self) -> None:
        timeout = self.config.request_timeout
        if timeout is None:
            return
        accepted_before = time.perf_counter() - timeout
        for seq in self.core.sequences():
            if seq.accepted_at < accepted_before:
                self._fail(seq, ErrorCode.TIMEOUT, f"the job ran past the request timeout of {timeout:g} s")

    # -- job state changes ----------------------------------------------------------------
    def _accepted(self, seq: Sequence) -> None:
        self.core.add(seq)
        self.telemetry.prompt_tokens.inc(len(seq.prompt_ids))
        self.output.started(seq)
        log.info("job accepted", extra={"job_id": seq.job_id, "seed": seq.seed, "prompt_tokens": len(seq.prompt_ids),
                                        "max_tokens": seq.max_tokens})

    def _finish(self, seq: Sequence, reason: StopReason) -> None:
        self.core.finish(seq)
        self._ended(seq)
        self.output.finish(seq, reason)

    def _fail(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        self.core.finish(seq)
        self._ended(seq)
        self.output.fail(seq, code, message)

    def _ended(self, seq: Sequence) -> None:
        """Forget a job the core has finished (its terminal event follows)."""
        with self._jobs_lock:
            if self._jobs.pop(seq.job_id, None) is not None and not seq.admitted:
                self._queued -= 1
