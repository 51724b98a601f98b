"""The engine: one thread that owns the model and runs the request lifecycle.

    submit -> inbox -> scheduler (waiting -> running) -> prefill -> decode steps
           -> sampler -> detokenizer -> stop matcher -> events -> finish (cache freed)

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
from llorch.engine.runner import ModelRunner
from llorch.engine.sampler import make_generator, sample
from llorch.engine.scheduler import Scheduler
from llorch.engine.sequence import Sequence, SequenceState
from llorch.engine.telemetry import Telemetry
from llorch.weights.tokenizer import Tokenizer

log = logging.getLogger("llorch.engine")

METRICS_INTERVAL_S = 1.0


@dataclass(frozen=True)
class RequestRejected(Exception):
    """A request that is well-formed but cannot be served as asked (a 400 naming the field)."""

    field: str
    constraint: str
    message: str


class DuplicateJob(Exception):
    pass


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        model_name: str,
        ctx_size: int,
        max_running: int = 4,
        telemetry: Telemetry | None = None,
        request_timeout: float | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.ctx_size = ctx_size
        self.device = runner.device
        self.scheduler = Scheduler(max_running)
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
        self.telemetry.kv_cache_bytes.set_function(lambda: self.runner.kv_bytes)
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

    def submit(self, request: GenerationRequest, prompt_ids: list[int], emit: Callable[[Event], None]) -> None:
        """Accept a job. Its events, starting with `started`, go to `emit` from the engine thread."""
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(64)
        seq = Sequence(request, prompt_ids, emit, IncrementalDetokenizer(
            self.tokenizer.decode, self.tokenizer.byte_token_ids, self.tokenizer.special_ids
        ), seed)
        with self._jobs_lock:
            if request.job_id in self._jobs:
                raise DuplicateJob(request.job_id)
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
                if seq.state is SequenceState.WAITING and seq in self.scheduler.waiting:
                    self._finish(seq, StopReason.CANCELLED)  # never ran: nothing to wait for
                else:
                    seq.cancel_requested = True
            elif kind == "abort":
                for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                    self._fail(seq, ErrorCode.CANCELLED, str(payload))

    def _step(self) -> None:
        if self.request_timeout is not None:
            self._expire(time.perf_counter() - self.request_timeout)
        plan = self.scheduler.plan()
        for seq in [*plan.prefill, *plan.decode]:
            if seq.cancel_requested:
                self._finish(seq, StopReason.CANCELLED)
                continue
            try:
                if seq.state is SequenceState.WAITING:
                    self._prefill(seq)
                else:
                    self._decode(seq)
            except torch.OutOfMemoryError as exc:
                self._fail(seq, ErrorCode.VRAM_OOM, f"out of memory: {exc}")
            except Exception as exc:  # one job's failure must not take down the others
                log.exception("step failed", extra={"job_id": seq.job_id})
                self._fail(seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}")

    def _expire(self, accepted_before: float) -> None:
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.accepted_at < accepted_before:
                self._fail(seq, ErrorCode.TIMEOUT, f"the job ran past the request timeout of "
                                                    f"{self.request_timeout:g} s")

    def _prefill(self, seq: Sequence) -> None:
        seq.decode_started = seq.last_metrics = time.perf_counter()
        seq.cache = self.runner.allocate_cache(seq.capacity)
        seq.generator = make_generator(seq.seed, self.device)
        seq.seen = torch.empty(seq.capacity, dtype=torch.long, device=self.device)
        prompt = torch.tensor(seq.prompt_ids, dtype=torch.long, device=self.device)
        seq.seen[: prompt.numel()] = prompt
        sampling = seq.request.sampling
        if sampling.presence_penalty or sampling.frequency_penalty:
            seq.generated_counts = torch.zeros(self.runner.config.vocab_size, device=self.device)
        seq.state = SequenceState.RUNNING
        logits = self.runner.forward(prompt, 0, seq.cache)
        self._accept_token(seq, logits)

    def _decode(self, seq: Sequence) -> None:
        assert seq.cache is not None and seq.last_token is not None
        started = time.perf_counter()
        logits = self.runner.forward(seq.last_token.view(1), seq.length - 1, seq.cache)
        self._accept_token(seq, logits)
        self.telemetry.time_per_output_token.observe(time.perf_counter() - started)

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
        seq.output_ids.append(token_id)
        seq.last_token = token
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
        if seq.state is SequenceState.RUNNING and reason is not StopReason.CANCELLED:
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
        if seq.cache is not None:
            self.runner.free_cache(seq.cache)
            seq.cache = None
        seq.seen = seq.last_token = seq.generator = seq.generated_counts = None
        seq.state = SequenceState.FINISHED
        self.scheduler.remove(seq)
        with self._jobs_lock:
            self._jobs.pop(seq.job_id, None)

    def _emit(self, seq: Sequence, event: Event) -> None:
        try:
            seq.emit(event)
        except Exception:  # a consumer that went away must not break the engine
            log.warning("event sink failed", extra={"job_id": seq.job_id, "event": event.type})
