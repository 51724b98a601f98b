"""One job's state while the engine owns it: tokens, KV blocks, sampler, text pipeline."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

import torch

from llorch.engine.detokenizer import IncrementalDetokenizer
from llorch.engine.kv_blocks import chain_hash
from llorch.engine.request import Event, GenerationRequest
from llorch.engine.stop import StopMatcher


class SequenceState(Enum):
    WAITING = "waiting"  # accepted (or preempted), holds no KV blocks
    RUNNING = "running"  # admitted: holds KV blocks, computing its prompt or decoding
    FINISHED = "finished"  # terminal event sent, resources freed


class Sequence:
    def __init__(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        emit: Callable[[Event], None],
        detokenizer: IncrementalDetokenizer,
        seed: int,
        arrival: int,
    ) -> None:
        self.request = request
        self.job_id = request.job_id
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.token_ids = list(prompt_ids)  # prompt + output: what the KV cache must come to hold
        self.arrival = arrival  # first come, first served: the order jobs were accepted in
        self.emit = emit
        self.detokenizer = detokenizer
        self.stop_matcher = StopMatcher(request.stop)
        self.seed = seed
        self.state = SequenceState.WAITING
        self.admitted = False  # ever admitted (a preempted job goes back to waiting admitted)
        self.cancel_requested = False
        # The KV cache: tokens [0, num_computed) are in the blocks of `block_table`.
        self.block_table: list[int] = []
        self.num_computed = 0
        self.registered_blocks = 0  # leading full blocks already offered to the prefix cache
        self._block_hashes: list[bytes] = []
        self.generator: torch.Generator | None = None
        self.seen: torch.Tensor | None = None  # on-device ids for the repetition penalty
        self.generated_counts: torch.Tensor | None = None  # on-device, for presence/frequency penalties
        self.events_sent = 0
        self.decode_started = 0.0
        self.last_metrics = 0.0
        self.accepted_at = time.perf_counter()

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def pending(self) -> int:
        """Known tokens not yet in the KV cache (1 while decoding: the last sampled token)."""
        return len(self.token_ids) - self.num_computed

    @property
    def capacity(self) -> int:
        return len(self.prompt_ids) + self.request.max_tokens

    def block_hashes(self, block_size: int) -> list[bytes]:
        """Prefix-cache addresses of every full block of the known tokens."""
        for i in range(len(self._block_hashes), len(self.token_ids) // block_size):
            parent = self._block_hashes[-1] if self._block_hashes else b""
            self._block_hashes.append(chain_hash(parent, self.token_ids[i * block_size : (i + 1) * block_size]))
        return self._block_hashes

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)
