"""One job's state while the engine owns it: its tokens, its KV blocks, its sampler and its text."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING

from llorch.engine.kv.block_table import BlockTable
from llorch.engine.kv.prefix import PrefixHashes
from llorch.engine.request import PreparedJob

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from llorch.engine.sampler import SamplerState
    from llorch.engine.speculative import RowSpeculation

# A prompt this long or longer has its own tokens computed as prompt rows: below it, unpacking the weights for the
# bfloat16 tiles costs more than it saves. Prefill of 24 / 32 / 64 tokens, the 1.1B file, int8 kernels against
# prompt rows (Xeon with AMX, two threads): 89 / 87, 103 / 96, 177 / 131 ms; of one token 23 / 75.
PROMPT_ROWS_FROM = 32


def prompt_rows(prompt_length: int, prompt_kernel: bool) -> int:
    """How many of a job's first tokens are computed as prompt rows (runner.ChunkInput.prompt) where the step
    has (or lacks) a kernel for them: the whole prompt when it is long enough to gain, else none."""
    return prompt_length if prompt_kernel and prompt_length >= PROMPT_ROWS_FROM else 0


class SequenceState(Enum):
    WAITING = "waiting"  # accepted (or preempted), holds no KV blocks
    RUNNING = "running"  # admitted: holds KV blocks, computing its prompt or decoding
    FINISHED = "finished"  # terminal event sent, resources freed


class Sequence:
    """A job's tokens and resources. The scheduler makes every change of its state (admission, blocks,
    accepted tokens, scoring progress, finishing); the output stage only reads it."""

    def __init__(self, job: PreparedJob, seed: int, arrival: int, block_size: int, prompt_kernel: bool = False,
                 ) -> None:
        self.request = job.request
        self.job_id = job.request.job_id
        self.max_tokens = job.max_tokens
        self.prompt_ids = list(job.prompt_ids)
        self.type_ids = job.type_ids  # a pooled job's segment ids (an encoder reads them beside the tokens)
        self.output_ids: list[int] = []
        self.token_ids = list(job.prompt_ids)  # prompt + output: what the KV cache must come to hold
        self.prompt_rows = prompt_rows(len(self.prompt_ids), prompt_kernel)  # its first tokens computed so
        self.arrival = arrival  # first come, first served: the order jobs were accepted in
        self.seed = seed
        self.sampler: SamplerState | None = None  # built at first admission, kept across preemptions
        self.grammar = job.grammar  # the compiled constraint, or None
        self.matcher: LLMatcher | None = None  # its state for this job: built with the sampler, freed at the end
        self.state = SequenceState.WAITING
        self.admitted_at = 0.0  # when it was first admitted (0: never); its decode clock starts there
        self.blocks = BlockTable(block_size)  # tokens [0, blocks.computed) are in the KV cache
        self.prefix = PrefixHashes(block_size)
        self.draft: list[int] = []  # tokens proposed after the last one, verified by the step being run
        self.speculation: RowSpeculation | None = None  # its proposal state, from its first proposal
        self.accepted_at = time.perf_counter()
        # Events its reader has not taken yet (None: a reader that takes each at once). A stream whose client
        # stops reading stops decoding at READER_BACKLOG (scheduler) instead of queueing events without end.
        self.backlog: Callable[[], int] | None = None
        # Prompt scoring (request.prompt_logprobs): the next prompt position whose log-probability is owed.
        # Position 0 has none; scoring is done when this reaches the prompt's length.
        self.next_scored = 1 if job.request.prompt_logprobs is not None else len(job.prompt_ids)

    @property
    def admitted(self) -> bool:
        """Ever admitted (a preempted job goes back to waiting admitted)."""
        return self.admitted_at > 0.0

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def pending(self) -> int:
        """Known tokens not yet in the KV cache (1 while decoding: the last sampled token)."""
        return len(self.token_ids) - self.blocks.computed

    @property
    def scoring(self) -> bool:
        """Prompt log-probabilities are still owed (their rows' logits are wanted as the prompt is read)."""
        return self.next_scored < len(self.prompt_ids)

    def scored_rows(self, start: int, tokens: int) -> range:
        """Of the rows [start, start + tokens) a step feeds, those whose logits score a prompt token not yet
        scored (row r scores token r + 1): recomputed rows that were scored before are skipped."""
        if not self.scoring:
            return range(0)
        return range(max(start, self.next_scored - 1), min(start + tokens, len(self.prompt_ids) - 1))

    def block_hashes(self) -> list[bytes]:
        """Prefix-cache addresses of every full block of the known tokens."""
        return self.prefix.of(self.token_ids, self.prompt_rows)

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)
