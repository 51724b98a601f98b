"""The engine core: synchronous, no threads and no callbacks. `add`, `finish`, `step() -> StepOutput`.

Each step is one forward pass over every running sequence: the decoding ones add their last
token, those still reading their prompt add a chunk of it (continuous batching). The scheduler
decides who runs and which KV blocks they use, the runner computes the logits, the sampler
picks every row's token at once, and the scheduler accepts them. What the step produced for
each job comes back as plain data; turning it into text and events is the output stage's
work, and the shell's thread calls both in turn.

A failure is kept to the job it belongs to: when the batched forward fails, each job is run
alone so only the failing one ends (rewriting the same KV slots with the same values is
harmless), and when batched sampling fails, each row is sampled alone.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from llorch.engine.arrays import concat
from llorch.engine.grammar import KIND_NAMES, engine_message, explained
from llorch.engine.masks import GrammarMasks, PendingMasks, mask_proposals
from llorch.engine.plan import Chunk, RowOutput, StepOutput, logit_rows
from llorch.engine.request import ErrorCode, StopReason
from llorch.engine.runner import ChunkInput, ModelRunner, out_of_memory
from llorch.engine.sampler import Sampled, SamplerState, sample_batch
from llorch.engine.scheduler import GrammarRefused, Scheduler
from llorch.engine.scoring import Pool, score_rows
from llorch.engine.sequence import Sequence, SequenceState
from llorch.engine.telemetry import Telemetry
from llorch.engine.verify import verify
from llorch.engine.views import EngineStats

if TYPE_CHECKING:
    from llorch.engine.arrays import Array as Tensor  # torch's, or the C step's numpy logits

log = logging.getLogger("llorch.engine")

class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, telemetry: Telemetry, pool: Pool | None = None
                 ) -> None:
        self.runner = runner
        self.pool = pool  # a reranker's or embedding model's output from a pooled job's last row
        self.scheduler = scheduler
        self.telemetry = telemetry
        self.masks = GrammarMasks(runner.config.vocab_size)
        blocks, t = scheduler.blocks, telemetry
        t.queue_depth.set_function(lambda: len(scheduler.waiting))
        t.running.set_function(lambda: len(scheduler.running))
        t.kv_cache_bytes.set_function(lambda: blocks.used_blocks * runner.kv.block_bytes)
        t.kv_cache_capacity_bytes.set_function(lambda: runner.kv.bytes)
        t.kv_cached_blocks.set_function(lambda: blocks.cached_blocks)
        t.weights_bytes.set_function(lambda: runner.weight_bytes)

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    @property
    def block_size(self) -> int:
        return self.runner.kv.block_size

    @property
    def resident_bytes(self) -> int:
        """The weights and the KV pool, a draft model's too."""
        speculation = self.scheduler.speculation
        return self.runner.resident_bytes + (speculation.resident_bytes if speculation is not None else 0)

    def sequences(self) -> list[Sequence]:
        """Every sequence the core holds: running, then waiting."""
        return [*self.scheduler.running, *self.scheduler.waiting]

    def find(self, job_id: str) -> Sequence | None:
        return self.scheduler.find(job_id)

    def stats(self, jobs_in_flight: int) -> EngineStats:
        counter, blocks = self.telemetry.registry.get_sample_value, self.scheduler.blocks
        return EngineStats(
            jobs_in_flight=jobs_in_flight, waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_blocks_used=blocks.used_blocks, kv_blocks_cached=blocks.cached_blocks,
            kv_bytes_used=blocks.used_blocks * self.runner.kv.block_bytes, kv_bytes_capacity=self.runner.kv.bytes,
            weights_bytes=self.runner.weight_bytes,
            prefix_cache_hit_tokens=int(counter("llorch_prefix_cache_hit_tokens_total") or 0),
            preemptions=int(counter("llorch_preemptions_total") or 0),
            generated_tokens=int(counter("llorch_generated_tokens_total") or 0),
            grammar_states=sum(s.matcher is not None for s in self.sequences()))

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def finish(self, seq: Sequence) -> None:
        """End a sequence now (cancelled, timed out, a stop string, a failure): its blocks are free."""
        self.scheduler.finish(seq)

    def step(self) -> StepOutput:
        """schedule -> forward -> score prompts -> sample -> accept."""
        plan = self.scheduler.schedule()
        out = StepOutput(ran=bool(plan.chunks))
        for seq in plan.admitted:
            self._admitted(seq, out)
        for seq in plan.resumed:
            log.info("job resumed", extra={"job_id": seq.job_id, "tokens": seq.length})
        for seq in plan.preempted:
            self.telemetry.preemptions.inc()
            log.info("job preempted: KV pool full", extra={"job_id": seq.job_id, "tokens": seq.length})
        self.telemetry.prefix_cache_hit_tokens.inc(plan.prefix_hit_tokens)
        if not plan.chunks:
            return out
        self.telemetry.batch_size.observe(len(plan.chunks))
        started = time.perf_counter()
        # Constrained rows' masks are computed on another thread while the forward pass runs.
        masks = self.masks.begin([c.seq for c in plan.chunks if c.completes])
        sampling, logits = self._run(plan.chunks, out)
        if sampling:
            self._sample(sampling, logits, masks, out)  # type: ignore[arg-type]
        generated = sum(len(row.sampled) for row in out.rows)
        if generated and all(chunk.tokens == 1 for chunk in plan.chunks):  # decoding rows only
            self.telemetry.time_per_output_token.observe((time.perf_counter() - started) * len(out.rows) / generated)
        return out

    def _admitted(self, seq: Sequence, out: StepOutput) -> None:
        """The first admission builds the job's sampler and grammar state (kept across preemptions)."""
        seq.sampler = SamplerState(seq.request.sampling, seq.seed, seq.prompt_ids, self.runner.config.vocab_size,
                                   self.runner.device, tuple(self.scheduler.eos_token_ids))
        if seq.grammar is not None:
            seq.matcher = seq.grammar.matcher()
        out.admitted.append(seq)

    def _run(self, chunks: list[Chunk], out: StepOutput) -> tuple[list[Sequence], Tensor | None]:
        """One forward over the step's chunks: the sequences that sample now, and their logits rows."""
        try:
            return self._forward(chunks, out)
        except Exception as exc:
            if len(chunks) == 1:
                self._fail_forward(chunks[0], exc, out)
                return [], None
        sampling: list[Sequence] = []
        rows: list[Tensor] = []
        for chunk in chunks:
            try:
                seqs, logits = self._forward([chunk], out)
            except Exception as exc:
                self._fail_forward(chunk, exc, out)
                continue
            sampling.extend(seqs)
            rows.append(logits)
        return sampling, concat(rows) if rows else None

    def _forward(self, chunks: list[Chunk], out: StepOutput) -> tuple[list[Sequence], Tensor]:
        """Run the chunks; score the prompt rows that were asked for; finish jobs that only read their prompt.
        The logits are each sampling sequence's rows in turn: its sampling row, then one per proposed token."""
        inputs, scored, pooled, sample_rows, row = [], [], [], [], 0
        sampling: list[Sequence] = []
        read_only = [c.seq for c in chunks if c.completes and c.seq.max_tokens == 0]
        for c in chunks:
            seq, start = c.seq, c.seq.blocks.computed
            rows = seq.scored_rows(start, c.tokens)
            samples, pools = c.completes and seq.max_tokens > 0, c.completes and seq.request.pooled
            ids = seq.token_ids[start : start + c.tokens] + c.draft
            offsets = range(rows.start - start, rows.stop - start)
            inputs.append(ChunkInput(ids, start, seq.blocks.blocks, samples or pools, offsets, len(c.draft), c.prompt))
            if rows:
                scored.append((seq, rows, row))
                row += len(rows)
            if pools:  # a pair to score or a text to embed: its prompt's last row
                pooled.append((seq, row))
                row += 1
            if samples:
                sampling.append(seq)
                sample_rows.extend(range(row, row + 1 + len(c.draft)))
                row += 1 + len(c.draft)
        logits = self.runner.forward(inputs)
        for chunk in chunks:
            self.scheduler.computed(chunk)
        for seq, rows, first in scored:
            self._score(seq, rows, logits[first : first + len(rows)], out)
        for seq, at in pooled:
            assert self.pool is not None, "only a reranker's or embedding model's front door prepares pooled jobs"
            self.scheduler.finish(seq)
            out.pooled.append((seq, self.pool(logits[at])))
        for seq in read_only:  # max_tokens=0: the prompt is read (and scored); nothing is generated
            if seq.state is not SequenceState.FINISHED:
                self.scheduler.finish(seq)
                out.finished.append((seq, StopReason.MAX_TOKENS))
        if len(sample_rows) != row:  # keep only the sampling rows
            logits = logits[sample_rows]
        live = [i for i, seq in enumerate(sampling) if seq.state is not SequenceState.FINISHED]
        if len(live) != len(sampling):  # a finished sequence has no proposals left: one row each
            sampling, logits = [sampling[i] for i in live], logits[logit_rows(sampling, live)]
        return sampling, logits

    def _score(self, seq: Sequence, rows: range, logits: Tensor, out: StepOutput) -> None:
        """The log-probabilities of prompt tokens rows.start + 1 .. rows.stop (row r scores token r + 1)."""
        try:
            targets = seq.prompt_ids[rows.start + 1 : rows.stop + 1]
            scores = score_rows(logits, targets, seq.request.prompt_logprobs or 0)
        except Exception as exc:  # one job's failure must not take down the others
            log.exception("prompt scoring failed", extra={"job_id": seq.job_id})
            self._fail(seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}", out)
            return
        self.scheduler.scored(seq, rows.start + 1 + len(scores))
        out.scores.append((seq, rows.start + 1, scores))

    def _sample(self, sampling: list[Sequence], logits: Tensor, masks: PendingMasks, out: StepOutput) -> None:
        """Every sampling row's tokens (a row with proposals verifies them), then the scheduler accepts each."""
        firsts = logit_rows(sampling, range(len(sampling)), first_only=True)  # each row's sampling row
        try:
            masks.apply(sampling, logits, firsts)
        except Exception as exc:  # only the constrained rows lose: sampled unmasked they would break their grammar
            log.exception("grammar masks failed")
            keep = [i for i, seq in enumerate(sampling) if seq.matcher is None]
            rows = logit_rows(sampling, keep)  # before failing: a finished row's proposals are gone
            for seq in sampling:
                if seq.matcher is not None:
                    self._fail(seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}", out)
            if not keep:
                return
            sampling, logits = [sampling[i] for i in keep], logits[rows]
            firsts = logit_rows(sampling, range(len(sampling)), first_only=True)
        if any(seq.draft for seq in sampling):
            tokens = self._verify_rows(sampling, logits, firsts, out)
        else:
            tokens = [None if s is None else [s] for s in self._sample_rows(sampling, logits, out)]
        for seq, kept in zip(sampling, tokens, strict=True):
            if kept is None:
                continue
            proposed = len(seq.draft)
            try:
                accepted = self.scheduler.accept(seq, [s.token_id for s in kept])
            except GrammarRefused as exc:
                self._fail(seq, ErrorCode.INFERENCE_FAILED, self._refusal(seq, exc), out)
                continue
            if accepted.reason is None:  # verification recorded the kept proposals already
                for token_id in accepted.tokens[len(kept) - 1 :]:
                    seq.sampler.accept(token_id)  # type: ignore[union-attr]
            if proposed:
                self.telemetry.proposed_tokens.inc(proposed)
                self.telemetry.accepted_proposals.inc(len(kept) - 1)
            out.rows.append(RowOutput(seq, kept, accepted.tokens, accepted.reason))

    def _sample_rows(self, sampling: list[Sequence], logits: Tensor, out: StepOutput) -> list[Sampled | None]:
        """One token per row (row i is sampling[i]'s), in one go; when that fails, row by row."""
        states = [seq.sampler for seq in sampling]
        assert all(state is not None for state in states)
        # The step's own argmax of these rows, unless they are a selection or a grammar's mask wrote into them.
        best = None if any(seq.matcher is not None for seq in sampling) else self.runner.best_of(logits)
        try:
            return sample_batch(logits, states, [seq.request.logprobs for seq in sampling], best)  # type: ignore[arg-type]
        except Exception:  # find the row that fails, so only its job ends
            return [self._sample_alone(seq, logits[i : i + 1], out) for i, seq in enumerate(sampling)]

    def _verify_rows(self, sampling: list[Sequence], logits: Tensor, firsts: list[int], out: StepOutput
                     ) -> list[list[Sampled] | None]:
        """Rows without proposals are sampled together; each row with proposals (from firsts[i]) verifies them."""
        plain = [i for i, seq in enumerate(sampling) if not seq.draft]
        tokens: list[list[Sampled] | None] = [None] * len(sampling)
        if plain:
            sampled = self._sample_rows([sampling[i] for i in plain], logits[[firsts[i] for i in plain]], out)
            for i, s in zip(plain, sampled, strict=True):
                tokens[i] = None if s is None else [s]
        for i, seq in enumerate(sampling):
            if not seq.draft:
                continue
            try:
                if seq.matcher is not None:  # each proposal row masked by the grammar after the ones before
                    mask_proposals(seq.matcher, seq.draft, logits[firsts[i] + 1 : firsts[i] + 1 + len(seq.draft)],
                                   self.masks.words)
                tokens[i] = verify(logits[firsts[i] : firsts[i] + 1 + len(seq.draft)], seq.draft, seq.sampler,  # type: ignore[arg-type]
                                   seq.request.logprobs)
            except Exception as exc:
                log.exception("verification failed", extra={"job_id": seq.job_id})
                self._fail(seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}", out)
        return tokens

    @staticmethod
    def _refusal(seq: Sequence, exc: GrammarRefused) -> str:
        kind = KIND_NAMES[seq.grammar.constraint.kind]
        detail = engine_message(seq.matcher.get_error()) if seq.matcher is not None else ""
        return f"RuntimeError: the {kind} refused token {exc.args[0]}: {explained(kind, detail)}"

    def _sample_alone(self, seq: Sequence, logits: Tensor, out: StepOutput) -> Sampled | None:
        try:
            return sample_batch(logits, [seq.sampler], [seq.request.logprobs])[0]  # type: ignore[list-item]
        except Exception as exc:
            log.exception("sampling failed", extra={"job_id": seq.job_id})
            self._fail(seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}", out)
            return None

    def _fail_forward(self, chunk: Chunk, exc: Exception, out: StepOutput) -> None:
        if out_of_memory(exc):
            self._fail(chunk.seq, ErrorCode.VRAM_OOM, f"out of memory: {exc}", out)
            return
        log.error("step failed", exc_info=exc, extra={"job_id": chunk.seq.job_id})
        self._fail(chunk.seq, ErrorCode.INFERENCE_FAILED, f"{type(exc).__name__}: {exc}", out)

    def _fail(self, seq: Sequence, code: ErrorCode, message: str, out: StepOutput) -> None:
        self.scheduler.finish(seq)
        out.failed.append((seq, code, message))

