"""One job's state while the engine owns it: tokens, KV cache, sampler, text pipeline."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

import torch

from llorch.engine.detokenizer import IncrementalDetokenizer
from llorch.engine.request import Event, GenerationRequest
from llorch.engine.stop import StopMatcher
from llorch.models.decoder import LayerKV


class SequenceState(Enum):
    WAITING = "waiting"  # accepted, not yet prefilled
    RUNNING = "running"  # prefilled, decoding one token per step
    FINISHED = "finished"  # terminal event sent, resources freed


class Sequence:
    def __init__(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        emit: Callable[[Event], None],
        detokenizer: IncrementalDetokenizer,
        seed: int,
    ) -> None:
        self.request = request
        self.job_id = request.job_id
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.emit = emit
        self.detokenizer = detokenizer
        self.stop_matcher = StopMatcher(request.stop)
        self.seed = seed
        self.state = SequenceState.WAITING
        self.cancel_requested = False
        self.cache: list[LayerKV] | None = None
        self.generator: torch.Generator | None = None
        self.seen: torch.Tensor | None = None  # on-device ids for the repetition penalty
        self.last_token: torch.Tensor | None = None  # on-device id fed to the next decode step
        self.generated_counts: torch.Tensor | None = None  # on-device, for presence/frequency penalties
        self.events_sent = 0
        self.decode_started = 0.0
        self.last_metrics = 0.0
        self.accepted_at = time.perf_counter()

    @property
    def length(self) -> int:
        """Tokens in the KV cache after the next step has written its input."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def capacity(self) -> int:
        return len(self.prompt_ids) + self.request.max_tokens
