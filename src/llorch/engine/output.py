"""The output stage: text and events only.

    sampled tokens -> logprob events -> accepted tokens -> detokenize -> stop match
                   -> token events -> metrics event (about once a second)

It decides nothing about a sequence's state: the scheduler has already accepted the
tokens (and ended the sequence at an end-of-generation token or max_tokens); a stop
string found in the text goes back to the engine, which ends the job. Per job,
JobOutput holds the text pipeline (incremental detokenizer and stop matcher), the
event sink and the counters its events need; the stage owns it from `open` to the
job's one terminal event.

Every number it emits is one JSON can carry: a log-probability of -inf (a token a grammar
rules out) is reported as ZERO_PROBABILITY_LOGPROB, and a NaN or +inf one (logits that
overflowed) raises NonFiniteLogits, which ends that job with an error event.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

from llorch.engine.detokenizer import IncrementalDetokenizer
from llorch.engine.request import (
    End,
    Error,
    ErrorCode,
    Event,
    Metrics,
    Pooled,
    PromptLogprobs,
    Started,
    StopReason,
    TokenLogprob,
    TokenText,
)
from llorch.engine.sampler import Sampled
from llorch.engine.sequence import Sequence, SequenceState
from llorch.engine.stop import StopMatcher
from llorch.engine.telemetry import Telemetry
from llorch.weights.tokenizer import Tokenizer

log = logging.getLogger("llorch.engine")

METRICS_INTERVAL_S = 1.0
ZERO_PROBABILITY_LOGPROB = -9999.0  # how -inf is reported (vLLM's choice too): JSON has no infinities


class NonFiniteLogits(ArithmeticError):
    """A log-probability came out NaN or +inf: the model's logits overflowed (its weights or configuration)."""


def wire_logprob(value: float, token_id: int) -> float:
    """`value` as a finite number, or NonFiniteLogits when nothing true can be said about the distribution."""
    if math.isfinite(value):
        return value
    if value == -math.inf:
        return ZERO_PROBABILITY_LOGPROB
    raise NonFiniteLogits(f"the model's log-probability of token {token_id} is {value}: its logits are not "
                          "finite (its weights or configuration overflow), so this job cannot report them")


class JobOutput:
    """One job's text so far: where its events go, detokenizer, stop matcher and event counters."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], emit: Callable[[Event], None]) -> None:
        self.emit = emit
        self.detokenizer = IncrementalDetokenizer(tokenizer.decode, tokenizer.byte_token_ids, tokenizer.special_ids)
        self.stop = StopMatcher(stop)
        self.events_sent = 0  # token events, numbering the next one
        self.sampled = 0  # tokens drawn for the job (an end-of-generation token included)
        self.tokens_out = 0  # generated tokens up to the end (a stop string's last token included)
        self.decode_started = 0.0
        self.last_metrics = 0.0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, model_name: str, telemetry: Telemetry,
                 resident_bytes: Callable[[], int]) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.telemetry = telemetry
        self._resident_bytes = resident_bytes
        self._jobs: dict[str, JobOutput] = {}
        self._lock = threading.Lock()  # `open` runs on the caller's thread, the rest on the engine's

    def open(self, job_id: str, stop: tuple[str, ...], emit: Callable[[Event], None]) -> None:
        """A job's text pipeline, built by the submitting thread (the detokenizer's set-up is not free)."""
        job = JobOutput(self.tokenizer, stop, emit)
        with self._lock:
            self._jobs[job_id] = job

    def _job(self, seq: Sequence) -> JobOutput:
        with self._lock:
            return self._jobs[seq.job_id]

    def started(self, seq: Sequence) -> None:
        started_at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        self._emit(seq, Started(seq.job_id, self.model_name, started_at))

    def decoding(self, seq: Sequence) -> None:
        """The job was admitted for the first time: its decode clock starts then (before that step ran)."""
        out = self._job(seq)
        out.decode_started = out.last_metrics = seq.admitted_at

    def prompt_scored(self, seq: Sequence, start: int, scores: list[tuple[float, tuple[tuple[int, float], ...]]]
                      ) -> None:
        """Prompt tokens `start`, `start` + 1, ... were scored: one event with their log-probabilities."""
        entries = tuple(self._logprob(token_id, logprob, top)
                        for token_id, (logprob, top) in zip(seq.prompt_ids[start : start + len(scores)], scores,
                                                            strict=True))
        self._emit(seq, PromptLogprobs(start, entries))

    def tokens(self, seq: Sequence, sampled: list[Sampled], accepted: list[int]) -> bool:
        """One step's tokens of a job: what was drawn (their log-probabilities) and what the scheduler
        appended (their text). True when a stop string is matched: the job ends there."""
        out = self._job(seq)
        # Token by token (a step may bring several): nothing after a stop string is reported.
        for position, draw in enumerate(sampled):
            self.telemetry.generated_tokens.inc()
            if out.sampled == 0:
                self.telemetry.time_to_first_token.observe(time.perf_counter() - seq.accepted_at)
            out.sampled += 1
            if draw.logprob is not None:
                self._emit(seq, self._logprob(draw.token_id, draw.logprob, draw.top))
            if position < len(accepted):
                out.tokens_out += 1
                self._text(seq, out.stop.feed(out.detokenizer.add(accepted[position])))
                if out.stop.matched is not None:
                    return True
        if seq.state is not SequenceState.FINISHED and time.perf_counter() - out.last_metrics >= METRICS_INTERVAL_S:
            self._metrics(seq)
        return False

    def finish(self, seq: Sequence, reason: StopReason) -> None:
        """The job's last text, a final metrics event and its `end` (the scheduler freed its blocks)."""
        out = self._job(seq)
        if seq.admitted and reason is not StopReason.CANCELLED:
            # Text held back for an unfinished character or a possible stop sequence.
            self._text(seq, out.stop.feed(out.detokenizer.flush()))
            self._text(seq, out.stop.flush())
            if out.stop.matched is not None:
                reason = StopReason.STOP_SEQUENCE
            self._metrics(seq)
        elapsed_ms = (time.perf_counter() - out.decode_started) * 1000 if out.decode_started else 0.0
        end = End(out.tokens_out, round(elapsed_ms, 3), reason, out.stop.matched)
        self.telemetry.requests.labels(outcome=reason.value.lower()).inc()
        self._close(seq, end)
        extra = {"job_id": seq.job_id, "stop_reason": reason.value, "tokens_out": end.tokens_out,
                 "decode_time_ms": end.decode_time_ms}
        if seq.speculation is not None and seq.speculation.proposed:
            extra.update(proposed_tokens=seq.speculation.proposed, accepted_proposals=seq.speculation.accepted)
        log.info("job finished", extra=extra)

    def pooled(self, seq: Sequence, values: tuple[float, ...]) -> None:
        """A pooled job's vector or score, then its `end`."""
        if not all(math.isfinite(v) for v in values):
            raise NonFiniteLogits("the model computed a value that is not finite for this input (its weights or "
                                  "configuration overflow)")
        self._emit(seq, Pooled(values, len(seq.prompt_ids)))
        out = self._job(seq)
        elapsed_ms = (time.perf_counter() - out.decode_started) * 1000 if out.decode_started else 0.0
        self.telemetry.pooled_inputs.labels(kind="rerank" if seq.request.pair is not None else "embed").inc()
        self.telemetry.requests.labels(outcome="pooled").inc()
        self._close(seq, End(0, round(elapsed_ms, 3), StopReason.MAX_TOKENS))
        log.info("job finished", extra={"job_id": seq.job_id, "pooled_values": len(values),
                                        "time_ms": round(elapsed_ms, 3)})

    def fail(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        self.telemetry.requests.labels(outcome=f"error_{code.value.lower()}").inc()
        self._close(seq, Error(code, message))
        log.error("job failed", extra={"job_id": seq.job_id, "code": code.value, "error": message})

    def _close(self, seq: Sequence, terminal: Event) -> None:
        """Send the job's one terminal event and forget it."""
        self._emit(seq, terminal)
        with self._lock:
            self._jobs.pop(seq.job_id, None)

    def _logprob(self, token_id: int, logprob: float, top: tuple[tuple[int, float], ...]) -> TokenLogprob:
        """One token's log-probability event (raises NonFiniteLogits before anything is emitted)."""
        decode = self.tokenizer.token_text
        return TokenLogprob(token_id, decode(token_id), wire_logprob(logprob, token_id),
                            tuple((i, decode(i), wire_logprob(value, i)) for i, value in top))

    def _text(self, seq: Sequence, text: str) -> None:
        if text:
            out = self._job(seq)
            self._emit(seq, TokenText(text, out.events_sent))
            out.events_sent += 1

    def _metrics(self, seq: Sequence) -> None:
        out = self._job(seq)
        out.last_metrics = time.perf_counter()
        elapsed = max(out.last_metrics - out.decode_started, 1e-9)
        self._emit(seq, Metrics(round(len(seq.output_ids) / elapsed, 2), self._resident_bytes()))

    def _emit(self, seq: Sequence, event: Event) -> None:
        with self._lock:
            out = self._jobs.get(seq.job_id)
        if out is None:  # ended already: a job has exactly one terminal event
            return
        try:
            out.emit(event)
        except Exception:  # a consumer that went away must not break the engine
            log.warning("event sink failed", extra={"job_id": seq.job_id, "event": event.type})
