"""The engine: one thread that owns the model and runs the request lifecycle.

    submit -> inbox -> scheduler (queue -> admitted with KV blocks) -> batched steps
           -> sampler -> detokenizer -> stop matcher -> events -> finish (blocks freed)

Each step is one forward pass over every running job: the decoding ones add their
last token, those still reading their prompt add a chunk of it (continuous batching).

The HTTP side only calls `prepare`, `submit` and `cancel` and receives plain events
through the callback it passed; it never touches a tensor. Every state change of a
job is logged once with its job_id.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from llorch.engine.detokenizer import IncrementalDetokenizer
from llorch.engine.kv_blocks import BlockPool
from llorch.engine.request import (
    End,
    Error,
    ErrorCode,
    Event,
    GenerationRequest,
    Metrics,
    Started,
    StopReason,
    TokenLogprob,
    TokenText,
)
from llorch.engine.runner import ModelRunner, Segment
from llorch.engine.sampler import make_generator, sample
from llorch.engine.scheduler import Chunk, Scheduler
from llorch.engine.sequence import Sequence, SequenceState
from llorch.engine.telemetry import Telemetry
from llorch.weights.tokenizer import Tokenizer

log = logging.getLogger("llorch.engine")

METRICS_INTERVAL_S = 1.0


@dataclass  # not frozen: raising sets __traceback__ on the instance
class RequestRejected(Exception):
    """A request that is well-formed but cannot be served as asked (a 400 naming the field)."""

    field: str
    constraint: str
    message: str


class DuplicateJob(Exception):
    pass


class QueueFull(Exception):
    """The worker already holds as many queued jobs as it accepts (the HTTP side answers 503)."""


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        model_name: str,
        ctx_size: int,
        max_running: int = 16,
        telemetry: Telemetry | None = None,
        request_timeout: float | None = None,
        max_prompt_tokens: int | None = None,
        max_queue: int = 64,
        max_batch_tokens: int = 512,
        prefix_caching: bool = True,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.ctx_size = ctx_size
        self.device = runner.device
        self.blocks = BlockPool(runner.num_blocks, runner.block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_running, max_batch_tokens)
        self.max_queue = max_queue
        self._queued = 0  # accepted jobs never admitted yet (guarded by _jobs_lock)
        self.largest_batch = 0  # most jobs that shared one forward step so far
        self._arrivals = 0
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._jobs: dict[str, Sequence] = {}
        self._jobs_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="llorch-engine", daemon=True)
        self._stopping = threading.Event()
        self.failed: BaseException | None = None
        self.request_timeout = request_timeout
        self.max_prompt_tokens = max_prompt_tokens
        self.telemetry = telemetry or Telemetry()
        self.telemetry.queue_depth.set_function(lambda: len(self.scheduler.waiting))
        self.telemetry.running.set_function(lambda: len(self.scheduler.running))
        self.telemetry.kv_cache_bytes.set_function(lambda: self.blocks.used_blocks * runner.block_bytes)
        self.telemetry.kv_cache_capacity_bytes.set_function(lambda: runner.kv_bytes)
        self.telemetry.kv_cached_blocks.set_function(lambda: self.blocks.cached_blocks)
        self.telemetry.weights_bytes.set_function(lambda: self.runner.weight_bytes)

    # -- called from the HTTP side --------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failed is None

    def prepare(self, request: GenerationRequest) -> list[int]:
        """Tokenize the prompt and check it fits the context with its max_tokens."""
        ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        self.check_fits(len(ids), request.max_tokens)
        return ids

    @property
    def max_sequence_tokens(self) -> int:
        """The most prompt + generated tokens one job may ask for: the context, or the whole KV pool."""
        return min(self.ctx_size, self.runner.tokens_per_pool)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise RequestRejected(
                "prompt", f"<= {self.max_prompt_tokens} tokens",
                f"the prompt is {prompt_tokens} tokens; this worker accepts at most {self.max_prompt_tokens}",
            )
        if prompt_tokens + max_tokens > self.ctx_size:
            raise RequestRejected(
                "max_tokens",
                f"prompt_tokens + max_tokens <= {self.ctx_size}",
                f"the prompt is {prompt_tokens} tokens; with max_tokens={max_tokens} it exceeds "
                f"the context size of {self.ctx_size} tokens",
            )
        if prompt_tokens + max_tokens > self.runner.tokens_per_pool:
            raise RequestRejected(
                "max_tokens",
                f"prompt_tokens + max_tokens <= {self.runner.tokens_per_pool}",
                f"the prompt is {prompt_tokens} tokens; with max_tokens={max_tokens} it needs more KV cache "
                f"than this worker's whole pool holds ({self.runner.tokens_per_pool} tokens, see --kv-cache-mb)",
            )

    def submit(self, request: GenerationRequest, prompt_ids: list[int], emit: Callable[[Event], None]) -> None:
        """Accept a job. Its events, starting with `started`, go to `emit` from the engine thread.

        Raises DuplicateJob for a job_id in flight, QueueFull when `max_queue` jobs already wait.
        """
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(64)
        detokenizer = IncrementalDetokenizer(
            self.tokenizer.decode, self.tokenizer.byte_token_ids, self.tokenizer.special_ids)
        with self._jobs_lock:
            if request.job_id in self._jobs:
                raise DuplicateJob(request.job_id)
            if self._queued >= self.max_queue:
                raise QueueFull(f"{self._queued} jobs are already waiting (--max-queue {self.max_queue})")
            self._queued += 1
            self._arrivals += 1
            seq = Sequence(request, prompt_ids, emit, detokenizer, seed, self._arrivals)
            self._jobs[request.job_id] = seq
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

    # -- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=self.scheduler.idle)
                if not self.scheduler.idle:
                    self._step()
        except BaseException as exc:  # the loop itself must never die silently
            self.failed = exc
            log.exception("engine loop failed; the worker is unhealthy")

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, payload = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                assert isinstance(payload, Sequence)
                self.scheduler.add(payload)
                self.telemetry.prompt_tokens.inc(len(payload.prompt_ids))
                started_at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
                self._emit(payload, Started(payload.job_id, self.model_name, started_at))
                log.info("job accepted", extra={"job_id": payload.job_id, "seed": payload.seed,
                                                "prompt_tokens": len(payload.prompt_ids),
                                                "max_tokens": payload.request.max_tokens})
            elif kind == "cancel":
                seq = self.scheduler.find(str(payload))
                if seq is None:
                    continue
                if seq.state is SequenceState.WAITING:
                    self._finish(seq, StopReason.CANCELLED)  # holds no blocks: nothing to wait for
                else:
                    seq.cancel_requested = True  # ended before the next step, freeing its blocks
            elif kind == "abort":
                for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                    self._fail(seq, ErrorCode.CANCELLED, str(payload))

    def _step(self) -> None:
        if self.request_timeout is not None:
            self._expire(time.perf_counter() - self.request_timeout)
        for seq in [s for s in self.scheduler.running if s.cancel_requested]:
            self._finish(seq, StopReason.CANCELLED)
        plan = self.scheduler.schedule()
        for seq in plan.admitted:
            self._admitted(seq)
        for seq in plan.preempted:
            self.telemetry.preemptions.inc()
            log.info("job preempted: KV pool full", extra={"job_id": seq.job_id, "tokens": seq.length})
        self.telemetry.prefix_cache_hit_tokens.inc(plan.prefix_hit_tokens)
        if not plan.chunks:
            return
        self.largest_batch = max(self.largest_batch, len(plan.chunks))
        self.telemetry.batch_size.observe(len(plan.chunks))
        started = time.perf_counter()
        for chunk, logits in self._forward(plan.chunks):
            chunk.seq.num_computed += chunk.tokens
            self.scheduler.register_full_blocks(chunk.seq)
            if logits is not None:
                try:
                    self._accept_token(chunk.seq, logits)
                except Exception as exc:  # one job's failure must not take down the others
                    log.exception("sampling failed", extra={"job_id": chunk.seq.job_id})
                    self._fail(chunk.seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}")
        if all(chunk.tokens == 1 for chunk in plan.chunks):
            self.telemetry.time_per_output_token.observe(time.perf_counter() - started)

    def _forward(self, chunks: list[Chunk]) -> list[tuple[Chunk, torch.Tensor | None]]:
        """Run the step; each chunk with the logits its next token is sampled from (None: mid-prompt).

        When the batched forward fails, each job is retried alone so only the failing one
        ends with an error (rewriting the same KV slots with the same values is harmless).
        """
        try:
            return self._forward_batch(chunks)
        except Exception as exc:
            if len(chunks) == 1:
                self._fail_forward(chunks[0], exc)
                return []
        results = []
        for chunk in chunks:
            try:
                results.extend(self._forward_batch([chunk]))
            except Exception as exc:
                self._fail_forward(chunk, exc)
        return results

    def _forward_batch(self, chunks: list[Chunk]) -> list[tuple[Chunk, torch.Tensor | None]]:
        segments = [Segment(c.seq.token_ids[c.seq.num_computed : c.seq.num_computed + c.tokens],
                            c.seq.num_computed, c.seq.block_table, c.completes) for c in chunks]
        logits = self.runner.forward(segments)
        rows = iter(logits)
        return [(c, next(rows) if c.completes else None) for c in chunks]

    def _fail_forward(self, chunk: Chunk, exc: Exception) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            self._fail(chunk.seq, ErrorCode.VRAM_OOM, f"out of memory: {exc}")
            return
        log.error("step failed", exc_info=exc, extra={"job_id": chunk.seq.job_id})
        self._fail(chunk.seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}")

    def _expire(self, accepted_before: float) -> None:
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.accepted_at < accepted_before:
                self._fail(seq, ErrorCode.TIMEOUT, f"the job ran past the request timeout of "
                                                    f"{self.request_timeout:g} s")

    def _admitted(self, seq: Sequence) -> None:
        """First admission: the job's sampler state (kept across preemptions)."""
        if seq.admitted:
            return
        seq.admitted = True
        with self._jobs_lock:
            self._queued -= 1
        seq.decode_started = seq.last_metrics = time.perf_counter()
        seq.generator = make_generator(seq.seed, self.device)
        seq.seen = torch.empty(seq.capacity, dtype=torch.long, device=self.device)
        seq.seen[: len(seq.prompt_ids)] = torch.tensor(seq.prompt_ids, dtype=torch.long, device=self.device)
        sampling = seq.request.sampling
        if sampling.presence_penalty or sampling.frequency_penalty:
            seq.generated_counts = torch.zeros(self.runner.config.vocab_size, device=self.device)

    def _accept_token(self, seq: Sequence, logits: torch.Tensor) -> None:
        assert seq.seen is not None
        token = sample(logits, seq.request.sampling, seq.seen[: seq.length], seq.generator, seq.generated_counts)
        token_id = int(token)  # the sampled id is the only value that leaves the device
        self.telemetry.generated_tokens.inc()
        if not seq.output_ids:
            self.telemetry.time_to_first_token.observe(time.perf_counter() - seq.accepted_at)
        if seq.request.logprobs is not None:
            self._emit_logprob(seq, logits, token_id)
        if token_id in self.tokenizer.eos_token_ids:
            self._finish(seq, StopReason.EOS)
            return
        seq.seen[seq.length] = token
        if seq.generated_counts is not None:
            seq.generated_counts[token] += 1
        seq.append(token_id)
        self._emit_text(seq, seq.stop_matcher.feed(seq.detokenizer.add(token_id)))
        if seq.stop_matcher.matched is not None:
            self._finish(seq, StopReason.STOP_SEQUENCE)
        elif len(seq.output_ids) >= seq.request.max_tokens:
            self._finish(seq, StopReason.MAX_TOKENS)
        elif time.perf_counter() - seq.last_metrics >= METRICS_INTERVAL_S:
            self._emit_metrics(seq)

    def _emit_logprob(self, seq: Sequence, logits: torch.Tensor, token_id: int) -> None:
        """Log-probabilities of the model's own distribution (before sampling filters).

        Only requested by the OpenAI API; a handful of floats leave the device per token.
        """
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top_k = seq.request.logprobs or 0
        values, ids = torch.topk(logprobs, top_k) if top_k else (logprobs[:0], logprobs[:0].long())
        decode = self.tokenizer.token_text
        top = tuple((int(i), decode(int(i)), float(v)) for v, i in zip(values.tolist(), ids.tolist(), strict=True))
        self._emit(seq, TokenLogprob(token_id, decode(token_id), float(logprobs[token_id]), top))

    def _emit_text(self, seq: Sequence, text: str) -> None:
        if text:
            self._emit(seq, TokenText(text, seq.events_sent))
            seq.events_sent += 1

    def _emit_metrics(self, seq: Sequence) -> None:
        seq.last_metrics = time.perf_counter()
        elapsed = max(seq.last_metrics - seq.decode_started, 1e-9)
        self._emit(seq, Metrics(round(len(seq.output_ids) / elapsed, 2), self.runner.resident_bytes))

    def _finish(self, seq: Sequence, reason: StopReason) -> None:
        if seq.admitted and reason is not StopReason.CANCELLED:
            # Text held back for an unfinished character or a possible stop sequence.
            self._emit_text(seq, seq.stop_matcher.feed(seq.detokenizer.flush()))
            if seq.stop_matcher.matched is not None:
                reason = StopReason.STOP_SEQUENCE
            self._emit_text(seq, seq.stop_matcher.flush())
            self._emit_metrics(seq)
        elapsed_ms = (time.perf_counter() - seq.decode_started) * 1000 if seq.decode_started else 0.0
        end = End(len(seq.output_ids), round(elapsed_ms, 3), reason, seq.stop_matcher.matched)
        self._release(seq)
        self.telemetry.requests.labels(outcome=reason.value.lower()).inc()
        self._emit(seq, end)
        log.info("job finished", extra={"job_id": seq.job_id, "stop_reason": reason.value,
                                        "tokens_out": end.tokens_out, "decode_time_ms": end.decode_time_ms})

    def _fail(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        self._release(seq)
        self.telemetry.requests.labels(outcome=f"error_{code.value.lower()}").inc()
        self._emit(seq, Error(code, message))
        log.error("job failed", extra={"job_id": seq.job_id, "code": code.value, "error": message})

    def _release(self, seq: Sequence) -> None:
        """Free the job's blocks and forget it (its terminal event follows)."""
        seq.seen = seq.generator = seq.generated_counts = None
        seq.state = SequenceState.FINISHED
        self.scheduler.remove(seq)
        with self._jobs_lock:
            self._jobs.pop(seq.job_id, None)
            if not seq.admitted:
                self._queued -= 1

    def _emit(self, seq: Sequence, event: Event) -> None:
        try:
            seq.emit(event)
        except Exception:  # a consumer that went away must not break the engine
            log.warning("event sink failed", extra={"job_id": seq.job_id, "event": event.type})
