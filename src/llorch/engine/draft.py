"""Speculative proposals from a draft model: a smaller model of the same vocabulary guesses ahead.

For the rows that propose in a step, the draft model first reads what it has not read of
each row's tokens (its prompt the first time, then the tokens the last step kept) and
proposes its argmax; each further proposal is one more draft step over those rows
together. The draft is greedy: its proposals are single tokens, which verification
(verify.py) keeps exactly where the target model chooses them too, greedy or sampled.

The draft model has a KV pool of its own (as many tokens as the target's) and a block
table per row. Its cache holds the row's tokens followed by the proposals it was fed;
after verification, only the entries up to the first proposal that was not kept still
match the row's tokens, and the next proposal starts reading from there. A row the draft
pool has no room for proposes nothing this step; a finished or preempted row's draft
blocks go back at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llorch.engine.kv.block_table import BlockTable
from llorch.engine.kv.blocks import BlockAllocator
from llorch.engine.runner import ChunkInput, ModelRunner
from llorch.engine.sampler import argmax
from llorch.engine.speculative import NgramSpeculation, Proposal, RowSpeculation


@dataclass
class DraftCache:
    """One row's draft KV: its blocks, and the tokens fed after the row's first `base` tokens."""

    table: BlockTable
    base: int = 0
    fed: list[int] = field(default_factory=list)


class DraftSpeculation(NgramSpeculation):
    """Proposals from a draft model; the row policy (lengths, pauses) is the n-gram one's."""

    def __init__(self, runner: ModelRunner, vocab_size: int, max_tokens: int, max_rows: int) -> None:
        super().__init__(max_tokens, max_rows)
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: a draft id past it (a padded embedding) ends a proposal
        self.blocks = BlockAllocator(runner.kv.num_blocks, runner.kv.block_size, prefix_caching=False)
        self.resident_bytes = runner.resident_bytes  # type: ignore[misc]

    def propose_rows(self, rows: list[Proposal]) -> list[list[int]]:
        wanted = [self._wanted(row) for row in rows]
        caches = {i: self._synced(row) for i, row in enumerate(rows) if wanted[i]}
        active = [i for i in caches if self._room(caches[i], len(rows[i].token_ids) + wanted[i])]
        drafts: list[list[int]] = [[] for _ in rows]
        if not active:
            return drafts
        with torch.inference_mode():
            # Catch up (single-token chunks first: they share one attention call), then the first proposals.
            order = sorted(active, key=lambda i: len(rows[i].token_ids) - caches[i].table.computed > 1)
            chunks = [self._catch_up(caches[i], rows[i].token_ids) for i in order]
            for i, token in zip(order, self._next(chunks), strict=True):
                drafts[i].append(token)
            for step in range(1, max(wanted[i] for i in active)):
                going = [i for i in active if wanted[i] > step and drafts[i][-1] < self.vocab_size]
                if not going:
                    break
                chunks = [self._feed(caches[i], drafts[i][-1]) for i in going]
                for i, token in zip(going, self._next(chunks), strict=True):
                    drafts[i].append(token)
        return [next((d[:j] for j, t in enumerate(d) if t >= self.vocab_size), d) for d in drafts]

    def forget(self, state: RowSpeculation) -> None:
        cache = state.cache
        if isinstance(cache, DraftCache):
            self.blocks.release(cache.table.clear())
        state.cache = None

    # -- one row -------------------------------------------------------------------------------------
    def _wanted(self, row: Proposal) -> int:
        wanted = self.wanted(row.state, row.limit)
        return wanted if len(row.token_ids) + wanted <= self.runner.config.context_length else 0

    def _synced(self, row: Proposal) -> DraftCache:
        """The row's draft cache, its computed count cut to the tokens that still match the row's."""
        cache = row.state.cache
        if not isinstance(cache, DraftCache):
            cache = row.state.cache = DraftCache(BlockTable(self.runner.kv.block_size))
        kept = 0
        for fed, token in zip(cache.fed, row.token_ids[cache.base :], strict=False):
            if fed != token:
                break
            kept += 1
        cache.table.computed = min(cache.table.computed, cache.base + kept)
        cache.base, cache.fed = cache.table.computed, []
        return cache

    def _room(self, cache: DraftCache, tokens: int) -> bool:
        """Blocks for `tokens` positions (all or none are taken)."""
        needed = self.blocks.blocks_for(tokens) - len(cache.table.blocks)
        if needed > self.blocks.free_blocks:
            return False
        cache.table.blocks.extend(self.blocks.allocate() for _ in range(max(0, needed)))  # type: ignore[misc]
        return True

    @staticmethod
    def _catch_up(cache: DraftCache, token_ids: list[int]) -> ChunkInput:
        start = cache.table.computed
        unread = token_ids[start:]
        if not unread:  # every token was read: read the last one again to get its logits
            start, unread = start - 1, token_ids[-1:]
        cache.table.computed = cache.base = start + len(unread)
        return ChunkInput(unread, start, cache.table.blocks, True)

    @staticmethod
    def _feed(cache: DraftCache, token: int) -> ChunkInput:
        start = cache.table.computed
        cache.table.computed += 1
        cache.fed.append(token)
        return ChunkInput([token], start, cache.table.blocks, True)

    def _next(self, chunks: list[ChunkInput]) -> list[int]:
        return [int(t) for t in argmax(self.runner.forward(chunks)).tolist()]
