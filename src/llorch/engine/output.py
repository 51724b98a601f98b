"""The output stage: what happens to each accepted token, and how a job's stream ends.

    sampled token -> logprob event -> end of generation? -> detokenize -> stop match
                  -> token event -> max_tokens? -> metrics event (about once a second)

Per sequence, SequenceOutput holds the text pipeline (incremental detokenizer and
stop matcher) and the counters its events need. OutputProcessor emits every event a
job produces, from `started` to its one terminal event; the engine decides when.

Every number it emits is one JSON can carry: a log-probability of -inf (a token a grammar
rules out) is reported as ZERO_PROBABILITY_LOGPROB, and a NaN or +inf one (logits that
overflowed) raises NonFiniteLogits, which ends that job with an error event.
"""

from __future__ import annotations

import logging
import math
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
    PromptLogprobs,
    Started,
    StopReason,
    TokenLogprob,
    TokenText,
)
from llorch.engine.sampler import Sampled
from llorch.engine.sequence import Sequence
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


class SequenceOutput:
    """One job's text so far: detokenizer, stop matcher and event counters."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer.decode, tokenizer.byte_token_ids, tokenizer.special_ids)
        self.stop = StopMatcher(stop)
        self.events_sent = 0  # token events, numbering the next one
        self.decode_started = 0.0
        self.last_metrics = 0.0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, model_name: str, telemetry: Telemetry,
                 resident_bytes: Callable[[], int]) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.telemetry = telemetry
        self._resident_bytes = resident_bytes

    def started(self, seq: Sequence) -> None:
        started_at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        self._emit(seq, Started(seq.job_id, self.model_name, started_at))

    def decoding(self, seq: Sequence) -> None:
        """The job was admitted for the first time: its decode clock starts."""
        seq.output.decode_started = seq.output.last_metrics = time.perf_counter()

    def prompt_scored(self, seq: Sequence, start: int, scores: list[tuple[float, tuple[tuple[int, float], ...]]]
                      ) -> None:
        """Prompt tokens `start`, `start` + 1, ... were scored: one event with their log-probabilities."""
        entries = tuple(self._logprob(token_id, logprob, top)
                        for token_id, (logprob, top) in zip(seq.prompt_ids[start : start + len(scores)], scores,
                                                            strict=True))
        seq.next_scored = start + len(scores)
        self._emit(seq, PromptLogprobs(start, entries))

    def accept(self, seq: Sequence, sampled: Sampled) -> StopReason | None:
        """Take one sampled token; the reason the job ends with it, or None to go on."""
        token_id = sampled.token_id
        self.telemetry.generated_tokens.inc()
        if not seq.output_ids:
            self.telemetry.time_to_first_token.observe(time.perf_counter() - seq.accepted_at)
        if sampled.logprob is not None:
            self._emit(seq, self._logprob(token_id, sampled.logprob, sampled.top))
        if token_id in self.tokenizer.eos_token_ids:
            return StopReason.EOS
        seq.append(token_id)
        out = seq.output
        self._text(seq, out.stop.feed(out.detokenizer.add(token_id)))
        if out.stop.matched is not None:
            return StopReason.STOP_SEQUENCE
        if len(seq.output_ids) >= seq.max_tokens:
            return StopReason.MAX_TOKENS
        if time.perf_counter() - out.last_metrics >= METRICS_INTERVAL_S:
            self._metrics(seq)
        return None

    def finish(self, seq: Sequence, reason: StopReason) -> None:
        """The job's last text, a final metrics event and its `end` (the engine freed its blocks)."""
        out = seq.output
        if seq.admitted and reason is not StopReason.CANCELLED:
            # Text held back for an unfinished character or a possible stop sequence.
            self._text(seq, out.stop.feed(out.detokenizer.flush()))
            if out.stop.matched is not None:
                reason = StopReason.STOP_SEQUENCE
            self._text(seq, out.stop.flush())
            self._metrics(seq)
        elapsed_ms = (time.perf_counter() - out.decode_started) * 1000 if out.decode_started else 0.0
        end = End(len(seq.output_ids), round(elapsed_ms, 3), reason, out.stop.matched)
        self.telemetry.requests.labels(outcome=reason.value.lower()).inc()
        self._emit(seq, end)
        log.info("job finished", extra={"job_id": seq.job_id, "stop_reason": reason.value,
                                        "tokens_out": end.tokens_out, "decode_time_ms": end.decode_time_ms})

    def fail(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        self.telemetry.requests.labels(outcome=f"error_{code.value.lower()}").inc()
        self._emit(seq, Error(code, message))
        log.error("job failed", extra={"job_id": seq.job_id, "code": code.value, "error": message})

    def _logprob(self, token_id: int, logprob: float, top: tuple[tuple[int, float], ...]) -> TokenLogprob:
        """One token's log-probability event (raises NonFiniteLogits before anything is emitted)."""
        decode = self.tokenizer.token_text
        return TokenLogprob(token_id, decode(token_id), wire_logprob(logprob, token_id),
                            tuple((i, decode(i), wire_logprob(value, i)) for i, value in top))

    def _text(self, seq: Sequence, text: str) -> None:
        if text:
            self._emit(seq, TokenText(text, seq.output.events_sent))
            seq.output.events_sent += 1

    def _metrics(self, seq: Sequence) -> None:
        out = seq.output
        out.last_metrics = time.perf_counter()
        elapsed = max(out.last_metrics - out.decode_started, 1e-9)
        self._emit(seq, Metrics(round(len(seq.output_ids) / elapsed, 2), self._resident_bytes()))

    def _emit(self, seq: Sequence, event: Event) -> None:
        try:
            seq.emit(event)
        except Exception:  # a consumer that went away must not break the engine
            log.warning("event sink failed", extra={"job_id": seq.job_id, "event": event.type})
