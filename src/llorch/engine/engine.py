"""The engine: one thread that owns the model and runs every job's lifecycle.

    prepare (front door) -> submit -> inbox -> each step: schedule -> run -> process outputs

Each step is one forward pass over every running job: the decoding ones add their
last token, those still reading their prompt add a chunk of it (continuous
batching). The scheduler decides who runs and which KV blocks they use, the runner
computes the logits, the sampler picks every row's token at once, and the output
stage turns tokens into events.

The HTTP side only calls `prepare`, `submit`, `cancel` and `stats`, and receives
plain events through the callback it passed; it never touches a tensor. Every state
change of a job (accepted, admitted, preempted, finished or failed) is logged once
with its job_id.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from llorch.engine.errors import DuplicateJob, QueueFull
from llorch.engine.grammar import KIND_NAMES, Grammars, engine_message, explained
from llorch.engine.kv.blocks import BlockPool
from llorch.engine.masks import GrammarMasks, PendingMasks
from llorch.engine.output import OutputProcessor, SequenceOutput
from llorch.engine.prepare import FrontDoor
from llorch.engine.request import ErrorCode, Event, GenerationRequest, PreparedJob, StopReason
from llorch.engine.runner import ModelRunner, Segment
from llorch.engine.sampler import Sampled, SamplerState, sample_batch
from llorch.engine.scheduler import Chunk, Scheduler
from llorch.engine.scoring import score_rows
from llorch.engine.sequence import Sequence, SequenceState
from llorch.engine.telemetry import Telemetry
from llorch.errors import StartupError
from llorch.models.config import ModelConfig
from llorch.weights.chat_template import ChatTemplate
from llorch.weights.model_facts import ModelFacts, read_model_facts, unknown_facts
from llorch.weights.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llorch.engine.config import EngineConfig

log = logging.getLogger("llorch.engine")


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


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig, *, model_name: str,
                 model_id: str, chat_template: ChatTemplate | None = None, telemetry: Telemetry | None = None,
                 model_path: Path | None = None) -> None:
        assert config.ctx_size is not None, "build_engine resolves the context size"
        self.runner = runner
        self.model_path = model_path  # the served file or directory (None: built from a model already loaded)
        self._facts: ModelFacts | None = None
        self.config = config
        self.model_name = model_name
        self.model_id = model_id
        self.ctx_size = config.ctx_size
        self.device = runner.device
        self.grammars = Grammars(tokenizer, runner.config.vocab_size)
        self.front = FrontDoor(tokenizer, chat_template, config.ctx_size, runner.kv.tokens, config.max_prompt_tokens,
                               self.grammars, runner.config.vocab_size)
        self.masks = GrammarMasks(runner.config.vocab_size)
        self.blocks = BlockPool(runner.kv.num_blocks, runner.kv.block_size, config.prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_running, config.max_batch_tokens)
        self.telemetry = telemetry or Telemetry()
        self.output = OutputProcessor(tokenizer, model_name, self.telemetry, lambda: self.resident_bytes)
        self._queued = 0  # accepted jobs never admitted yet (guarded by _jobs_lock)
        self._arrivals = 0
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._jobs: dict[str, Sequence] = {}
        self._jobs_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="llorch-engine", daemon=True)
        self._stopping = threading.Event()
        self.failed: BaseException | None = None
        t = self.telemetry
        t.queue_depth.set_function(lambda: len(self.scheduler.waiting))
        t.running.set_function(lambda: len(self.scheduler.running))
        t.kv_cache_bytes.set_function(lambda: self.blocks.used_blocks * runner.kv.block_bytes)
        t.kv_cache_capacity_bytes.set_function(lambda: runner.kv.bytes)
        t.kv_cached_blocks.set_function(lambda: self.blocks.cached_blocks)
        t.weights_bytes.set_function(lambda: runner.weight_bytes)

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
        """Bytes the weights and the KV pool hold on the device (the contract's vram_bytes)."""
        return self.runner.resident_bytes

    @property
    def model_config(self) -> ModelConfig:
        """The model's shapes and switches (a fact for listings; nothing to change)."""
        return self.runner.config

    def model_facts(self) -> ModelFacts:
        """The model file's facts for listings, read once (it hashes the file unless a load already did)."""
        if self._facts is None:
            try:
                self._facts = read_model_facts(self.model_path, self.runner.config) if self.model_path else None
            except (OSError, ValueError, StartupError):
                self._facts = None
            self._facts = self._facts or unknown_facts(self.runner.config, self.runner.weight_bytes)
        return self._facts

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self.front.chat_template

    def prepare(self, request: GenerationRequest) -> PreparedJob:
        """Render, tokenize and size a request (raises RequestRejected naming the field)."""
        return self.front.prepare(request)

    def submit(self, job: PreparedJob, emit: Callable[[Event], None]) -> None:
        """Accept a job. Its events, starting with `started`, go to `emit` from the engine thread.

        Raises DuplicateJob for a job_id in flight, QueueFull when `max_queue` jobs already wait.
        """
        request = job.request
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(64)
        output = SequenceOutput(self.front.tokenizer, request.stop)
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
            seq = Sequence(job, emit, output, seed, self._arrivals, self.runner.kv.block_size)
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

    def stats(self) -> EngineStats:
        counter = self.telemetry.registry.get_sample_value
        return EngineStats(
            jobs_in_flight=self.jobs_in_flight, waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running), kv_blocks_used=self.blocks.used_blocks,
            kv_blocks_cached=self.blocks.cached_blocks,
            kv_bytes_used=self.blocks.used_blocks * self.runner.kv.block_bytes,
            kv_bytes_capacity=self.runner.kv.bytes, weights_bytes=self.runner.weight_bytes,
            prefix_cache_hit_tokens=int(counter("llorch_prefix_cache_hit_tokens_total") or 0),
            preemptions=int(counter("llorch_preemptions_total") or 0),
            generated_tokens=int(counter("llorch_generated_tokens_total") or 0),
            grammar_states=sum(s.matcher is not None for s in [*self.scheduler.running, *self.scheduler.waiting]),
        )

    # -- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=self.scheduler.idle)
                if not self.scheduler.idle:
                    self._step()
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
                    self.output.fail(seq, ErrorCode.INFERENCE_FAILED, why)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, payload = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                assert isinstance(payload, Sequence)
                self._accepted(payload)
            elif kind == "cancel":
                seq = self.scheduler.find(str(payload))
                if seq is None:
                    continue
                log.info("cancel requested", extra={"job_id": seq.job_id, "state": seq.state.value})
                if seq.state is SequenceState.WAITING:
                    self._finish(seq, StopReason.CANCELLED)  # holds no blocks: nothing to wait for
                else:
                    seq.cancel_requested = True  # ended before the next step, freeing its blocks
            elif kind == "abort":
                for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                    self._fail(seq, ErrorCode.CANCELLED, str(payload))

    def _step(self) -> None:
        """schedule -> run -> process outputs."""
        self._end_timed_out_and_cancelled()
        plan = self.scheduler.schedule()
        for seq in plan.admitted:
            self._admitted(seq)
        for seq in plan.preempted:
            self.telemetry.preemptions.inc()
            log.info("job preempted: KV pool full", extra={"job_id": seq.job_id, "tokens": seq.length})
        self.telemetry.prefix_cache_hit_tokens.inc(plan.prefix_hit_tokens)
        if not plan.chunks:
            return
        self.telemetry.batch_size.observe(len(plan.chunks))
        started = time.perf_counter()
        # Constrained rows' masks are computed on another thread while the forward pass runs.
        masks = self.masks.begin([c.seq for c in plan.chunks if c.completes])
        sampling, logits = self._run(plan.chunks)
        if sampling:
            self._process(sampling, logits, masks)
        if all(chunk.tokens == 1 for chunk in plan.chunks):
            self.telemetry.time_per_output_token.observe(time.perf_counter() - started)

    def _run(self, chunks: list[Chunk]) -> tuple[list[Sequence], Tensor]:
        """One forward over the step's chunks: the sequences that sample now, and their logits rows.

        When the batched forward fails, each job is retried alone so only the failing one
        ends with an error (rewriting the same KV slots with the same values is harmless).
        """
        try:
            return self._forward(chunks)
        except Exception as exc:
            if len(chunks) == 1:
                self._fail_forward(chunks[0], exc)
                return [], torch.empty(0)
        sampling: list[Sequence] = []
        rows: list[Tensor] = []
        for chunk in chunks:
            try:
                seqs, logits = self._forward([chunk])
            except Exception as exc:
                self._fail_forward(chunk, exc)
                continue
            sampling.extend(seqs)
            rows.append(logits)
        return sampling, torch.cat(rows) if rows else torch.empty(0)

    def _forward(self, chunks: list[Chunk]) -> tuple[list[Sequence], Tensor]:
        """Run the chunks; score the prompt rows that were asked for; finish jobs that only read their prompt."""
        segments, scored, sample_rows, row = [], [], [], 0
        sampling: list[Sequence] = []
        read_only = [c.seq for c in chunks if c.completes and c.seq.max_tokens == 0]
        for c in chunks:
            seq, start = c.seq, c.seq.blocks.computed
            rows = seq.scored_rows(start, c.tokens)
            samples = c.completes and seq.max_tokens > 0
            segments.append(Segment(seq.token_ids[start : start + c.tokens], start, seq.blocks.blocks, samples,
                                    range(rows.start - start, rows.stop - start)))
            if rows:
                scored.append((seq, rows, row))
                row += len(rows)
            if samples:
                sampling.append(seq)
                sample_rows.append(row)
                row += 1
        logits = self.runner.forward(segments)
        for chunk in chunks:
            self.scheduler.computed(chunk)
        for seq, rows, first in scored:
            self._score(seq, rows, logits[first : first + len(rows)])
        for seq in read_only:  # max_tokens=0: the prompt is read (and scored); nothing is generated
            if seq.state is not SequenceState.FINISHED:
                self._finish(seq, StopReason.MAX_TOKENS)
        if len(sample_rows) != row:  # keep only the sampling rows
            logits = logits[sample_rows]
        live = [i for i, seq in enumerate(sampling) if seq.state is not SequenceState.FINISHED]
        if len(live) != len(sampling):
            sampling, logits = [sampling[i] for i in live], logits[live]
        return sampling, logits

    def _score(self, seq: Sequence, rows: range, logits: Tensor) -> None:
        """Emit the log-probabilities of prompt tokens rows.start + 1 .. rows.stop (row r scores token r + 1)."""
        try:
            targets = seq.prompt_ids[rows.start + 1 : rows.stop + 1]
            scores = score_rows(logits, targets, seq.request.prompt_logprobs or 0)
            self.output.prompt_scored(seq, rows.start + 1, scores)
        except Exception as exc:  # one job's failure must not take down the others
            log.exception("prompt scoring failed", extra={"job_id": seq.job_id})
            self._fail(seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}")

    def _process(self, sampling: list[Sequence], logits: Tensor, masks: PendingMasks) -> None:
        """Every sampling row's token in one go, then each job's output stage."""
        masks.apply(sampling, logits)
        states = [seq.sampler for seq in sampling]
        assert all(state is not None for state in states)
        try:
            tokens = sample_batch(logits, states, [seq.request.logprobs for seq in sampling])  # type: ignore[arg-type]
        except Exception:  # find the row that fails, so only its job ends
            tokens = [self._sample_alone(seq, logits[i : i + 1]) for i, seq in enumerate(sampling)]
        for seq, sampled in zip(sampling, tokens, strict=True):
            if sampled is None:
                continue
            try:
                reason = self.output.accept(seq, sampled)
                if reason is None:
                    seq.sampler.accept(sampled.token_id)  # type: ignore[union-attr]
                    reason = self._advance_grammar(seq, sampled.token_id)
            except Exception as exc:  # one job's failure must not take down the others
                log.exception("output failed", extra={"job_id": seq.job_id})
                self._fail(seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}")
                continue
            if reason is not None:
                self._finish(seq, reason)

    def _advance_grammar(self, seq: Sequence, token_id: int) -> StopReason | None:
        """Feed a constrained job's grammar its token; EOS when the grammar admits nothing more."""
        if seq.matcher is None:
            return None
        if not seq.matcher.consume_token(token_id):
            kind = KIND_NAMES[seq.grammar.constraint.kind]
            raise RuntimeError(f"the {kind} refused token {token_id}: "
                               f"{explained(kind, engine_message(seq.matcher.get_error()))}")
        return StopReason.EOS if seq.matcher.is_stopped() else None

    def _sample_alone(self, seq: Sequence, logits: Tensor) -> Sampled | None:
        try:
            return sample_batch(logits, [seq.sampler], [seq.request.logprobs])[0]  # type: ignore[list-item]
        except Exception as exc:
            log.exception("sampling failed", extra={"job_id": seq.job_id})
            self._fail(seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}")
            return None

    def _fail_forward(self, chunk: Chunk, exc: Exception) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            self._fail(chunk.seq, ErrorCode.VRAM_OOM, f"out of memory: {exc}")
            return
        log.error("step failed", exc_info=exc, extra={"job_id": chunk.seq.job_id})
        self._fail(chunk.seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}")

    def _end_timed_out_and_cancelled(self) -> None:
        timeout = self.config.request_timeout
        if timeout is not None:
            accepted_before = time.perf_counter() - timeout
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                if seq.accepted_at < accepted_before:
                    self._fail(seq, ErrorCode.TIMEOUT, f"the job ran past the request timeout of {timeout:g} s")
        for seq in [s for s in self.scheduler.running if s.cancel_requested]:
            self._finish(seq, StopReason.CANCELLED)

    # -- job state changes ----------------------------------------------------------------
    def _accepted(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self.telemetry.prompt_tokens.inc(len(seq.prompt_ids))
        self.output.started(seq)
        log.info("job accepted", extra={"job_id": seq.job_id, "seed": seq.seed, "prompt_tokens": len(seq.prompt_ids),
                                        "max_tokens": seq.max_tokens})

    def _admitted(self, seq: Sequence) -> None:
        """Waiting -> running. The first admission builds the job's sampler (kept across preemptions)."""
        if seq.admitted:
            log.info("job resumed", extra={"job_id": seq.job_id, "tokens": seq.length})
            return
        seq.admitted = True
        with self._jobs_lock:
            self._queued -= 1
        seq.sampler = SamplerState(seq.request.sampling, seq.seed, seq.prompt_ids, self.runner.config.vocab_size,
                                   self.device, self.front.tokenizer.eos_token_ids)
        if seq.grammar is not None:
            seq.matcher = seq.grammar.matcher()
        self.output.decoding(seq)
        log.info("job admitted", extra={"job_id": seq.job_id, "prefix_cached_tokens": seq.blocks.computed})

    def _finish(self, seq: Sequence, reason: StopReason) -> None:
        self._release(seq)
        self.output.finish(seq, reason)

    def _fail(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        self._release(seq)
        self.output.fail(seq, code, message)

    def _release(self, seq: Sequence) -> None:
        """Free the job's blocks and forget it (its terminal event follows)."""
        seq.sampler = None
        seq.matcher = None
        seq.state = SequenceState.FINISHED
        self.scheduler.remove(seq)
        with self._jobs_lock:
            self._jobs.pop(seq.job_id, None)
            if not seq.admitted:
                self._queued -= 1
