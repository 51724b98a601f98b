"""What the next engine step computes: continuous batching over a paged KV pool, first come, first served.

Each step, every running sequence advances: a decoding one by its last sampled
token, one still reading its prompt by a chunk of it. Prompt chunks share a budget
of `max_batch_tokens` per step, so a long prompt is read over several steps while
the others keep streaming. Waiting jobs are admitted strictly in arrival order
(never skipped by a later, smaller job) while fewer than `max_running` run and the
pool has room for the whole prompt plus one block for each running sequence.

A running sequence that needs a block when none is free takes one from the most
recently admitted sequence, which is preempted: its blocks are released and it goes
back to the queue at its arrival position, to recompute its tokens when readmitted
(its stream simply pauses). The oldest job therefore always makes progress.

The scheduler makes every change of a sequence's state: admission, blocks, the tokens
a step accepts (none, one or several per row), the ends that follow from them (an
end-of-generation token, max_tokens, the grammar's end), prompt-scoring progress and
finishing. The engine core only asks it and reports what the model produced.

A decoding row may also feed tokens proposed for it (speculative.py) after its last one,
with blocks to spare (a proposal never preempts). Of their cache entries, only those of
proposals kept count as computed (later tokens overwrite the others).

A job that scores its prompt needs the logits of every prompt row, not just the last:
its chunks are capped so that a step never asks for more than SCORED_ROWS_PER_STEP
such rows (the [rows x vocabulary] logits of a whole long prompt never exist at once),
and it reuses prefix-cached blocks only as far as it has scored already (cached
blocks keep keys and values, not logits).

A decoding row whose reader has left READER_BACKLOG events untaken (a client that stopped
reading its stream) is skipped until the reader catches up: a slow reader slows its own
job, and what waits for it stays bounded, where the events would otherwise queue until
max_tokens or the write deadline.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from llorch.engine.kv.blocks import BlockAllocator
from llorch.engine.plan import Accepted, Chunk, StepPlan
from llorch.engine.request import StopReason
from llorch.engine.sequence import Sequence, SequenceState
from llorch.engine.speculative import NgramSpeculation, Proposal, RowSpeculation

# Rows of prompt-scoring logits one step may produce: 64 rows of a 262k vocabulary are 64 MiB of float32.
SCORED_ROWS_PER_STEP = 64


# Events a stream's reader may leave untaken before its job stops decoding (a few times what one step of a
# speculating row emits; logprobs double the events per token).
READER_BACKLOG = 256


class GrammarRefused(RuntimeError):
    """A constrained job's grammar refused a token its own mask allowed (a grammar engine fault)."""


def held(seq: Sequence) -> bool:
    """Its reader has left READER_BACKLOG events untaken: the job keeps its KV blocks and waits."""
    return seq.backlog is not None and seq.backlog() >= READER_BACKLOG

class Scheduler:
    def __init__(self, blocks: BlockAllocator, max_running: int, max_batch_tokens: int,
                 eos_token_ids: Iterable[int] = (), speculation: NgramSpeculation | None = None) -> None:
        self.blocks = blocks
        self.speculation = speculation
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._scored_left = SCORED_ROWS_PER_STEP  # prompt-scoring rows this step may still take

    def add(self, seq: Sequence) -> None:
        """Queue a job at its arrival position (a preempted job goes back ahead of later arrivals)."""
        if not self.waiting or self.waiting[-1].arrival < seq.arrival:
            self.waiting.append(seq)
            return
        index = next(i for i, other in enumerate(self.waiting) if other.arrival > seq.arrival)
        self.waiting.insert(index, seq)

    def find(self, job_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.job_id == job_id:
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """End a sequence: forget it, release its blocks and its sampling state (idempotent)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_blocks(seq)
        seq.state = SequenceState.FINISHED
        seq.sampler = None
        seq.matcher = None
        seq.draft = []

    def accept(self, seq: Sequence, token_ids: Iterable[int]) -> Accepted:
        """Append a row's tokens of this step, in order, up to the first that ends the sequence.

        Raises GrammarRefused (the sequence is left for the caller to fail).
        """
        appended: list[int] = []
        reason: StopReason | None = None
        for token_id in token_ids:
            if token_id in self.eos_token_ids:
                reason = StopReason.EOS
                break
            seq.append(token_id)
            appended.append(token_id)
            if len(seq.output_ids) >= seq.max_tokens:
                reason = StopReason.MAX_TOKENS
                break
            if seq.matcher is not None:
                if not seq.matcher.consume_token(token_id):
                    raise GrammarRefused(token_id)
                if seq.matcher.is_stopped():  # the grammar admits nothing more
                    reason = StopReason.EOS
                    break
        if reason is not None:
            self.finish(seq)
        elif seq.draft:
            self._verified(seq, appended)
        return Accepted(appended, reason)

    def _verified(self, seq: Sequence, appended: list[int]) -> None:
        """The proposals kept (the leading tokens equal to them) are computed; spare blocks go back."""
        kept = 0
        for token, proposed in zip(appended, seq.draft, strict=False):  # a row may end before its proposals do
            if token != proposed:
                break
            kept += 1
        if self.speculation is not None and seq.speculation is not None:
            self.speculation.verified(seq.speculation, len(seq.draft), kept)
        seq.draft, table = [], seq.blocks
        table.computed += kept
        self._register(seq)
        spare = table.blocks[self.blocks.blocks_for(seq.length) :]
        del table.blocks[len(table.blocks) - len(spare) :]
        self.blocks.release(spare)

    def scored(self, seq: Sequence, upto: int) -> None:
        """Prompt tokens before `upto` have their log-probabilities."""
        seq.next_scored = max(seq.next_scored, upto)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- planning ---------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        singles: list[Chunk] = []
        prompts: list[Chunk] = []
        budget = self.max_batch_tokens
        self._scored_left = SCORED_ROWS_PER_STEP
        for seq in list(self.running):
            if seq.state is not SequenceState.RUNNING:  # preempted earlier in this loop
                continue
            tokens = 1 if seq.pending == 1 else self._chunk(seq, budget)
            if tokens == 0 or (tokens == 1 and held(seq)):
                continue
            if not self._grow(seq, seq.blocks.computed + tokens, plan):
                continue
            (singles if tokens == 1 else prompts).append(Chunk(seq, tokens))
            if seq.pending > 1:
                budget -= tokens
        if not plan.preempted:  # a pool tight enough to preempt admits nobody this step
            budget = self._admit(plan, prompts, budget)
        self._propose(singles, budget)
        plan.chunks = singles + prompts
        return plan

    def _propose(self, singles: list[Chunk], budget: int) -> None:
        """Proposed tokens for decoding rows, from what the step's token budget leaves."""
        for chunk in singles:
            chunk.seq.draft = []
        speculation = self.speculation
        if speculation is None or len(singles) > speculation.max_rows:
            return
        rows = [c.seq for c in singles if c.completes and not c.seq.scoring]  # scoring rows' logits score
        for seq in rows:
            seq.speculation = seq.speculation or RowSpeculation()
        limits = [seq.max_tokens - len(seq.output_ids) - 1 for seq in rows]
        drafts = speculation.propose_rows([Proposal(seq.speculation, seq.token_ids, min(budget, limit))  # type: ignore[arg-type]
                                           for seq, limit in zip(rows, limits, strict=True)])
        for seq, draft in zip(rows, drafts, strict=True):
            draft = draft[: max(0, budget)]
            if draft and seq.matcher is not None:  # a proposal the grammar refuses ends them
                draft = draft[: seq.matcher.validate_tokens(draft)]
            seq.draft = draft[: self._room(seq, len(draft))]
            budget -= len(seq.draft)

    def _room(self, seq: Sequence, wanted: int) -> int:
        """How many proposed tokens fit in `seq`'s blocks after its last token, taking free blocks
        for up to `wanted` of them (never preempting)."""
        size = self.blocks.block_size
        end = seq.blocks.computed + 1 + wanted
        while len(seq.blocks.blocks) < self.blocks.blocks_for(end) and self.blocks.free_blocks:
            block = self.blocks.allocate()
            assert block is not None
            seq.blocks.blocks.append(block)
        return max(0, min(wanted, len(seq.blocks.blocks) * size - seq.blocks.computed - 1))

    def _admit(self, plan: StepPlan, prompts: list[Chunk], budget: int) -> int:
        size = self.blocks.block_size
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            seq = self.waiting[0]
            # At least the last known token is computed: its logits give the next token.
            reusable = (seq.length - 1) // size
            if seq.scoring:  # recompute the rows still to score: cached blocks have no logits
                reusable = min(reusable, (seq.next_scored - 1) // size)
            hits = self.blocks.lookup(seq.block_hashes()[:reusable])
            fresh = self.blocks.blocks_for(seq.length) - len(hits)
            headroom = len(self.running)  # one block for each running sequence's next token
            if self.blocks.free_blocks - self.blocks.free_among(hits) < fresh + headroom:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.blocks.take(hits)
            table = seq.blocks
            table.blocks = list(hits)
            for _ in range(fresh):
                block = self.blocks.allocate()
                assert block is not None
                table.blocks.append(block)
            table.registered = len(hits)
            table.computed = len(hits) * size
            plan.prefix_hit_tokens += table.computed
            seq.state = SequenceState.RUNNING
            self.running.append(seq)
            if not seq.admitted:
                seq.admitted_at = time.perf_counter()
                plan.admitted.append(seq)
            else:
                plan.resumed.append(seq)
            tokens = self._chunk(seq, budget)
            if tokens:
                prompts.append(Chunk(seq, tokens))
            budget -= tokens
        return budget

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of a sequence's pending prompt tokens this step feeds."""
        tokens = min(seq.pending, budget)
        if seq.scoring:
            tokens = min(tokens, self._scored_left)
            self._scored_left -= tokens
        return tokens

    def _grow(self, seq: Sequence, tokens: int, plan: StepPlan) -> bool:
        """Blocks for `tokens` tokens of `seq`, preempting newer sequences if need be (False: seq itself)."""
        while len(seq.blocks.blocks) < self.blocks.blocks_for(tokens):
            block = self.blocks.allocate()
            if block is None:
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    return False
                continue
            seq.blocks.blocks.append(block)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.state = SequenceState.WAITING
        self.add(seq)

    def _release_blocks(self, seq: Sequence) -> None:
        self.blocks.release(seq.blocks.clear())
        if self.speculation is not None and seq.speculation is not None:
            self.speculation.forget(seq.speculation)

    def computed(self, chunk: Chunk) -> None:
        """The chunk's known tokens are in the KV cache now (its proposals count once kept)."""
        chunk.seq.blocks.computed += chunk.tokens
        self._register(chunk.seq)

    def _register(self, seq: Sequence) -> None:
        """Offer newly completed blocks of computed, known tokens to the prefix cache."""
        table = seq.blocks
        full = table.computed // self.blocks.block_size
        if full > table.registered:
            hashes = seq.block_hashes()
            for i in range(table.registered, full):
                self.blocks.register(table.blocks[i], hashes[i])
            table.registered = full
