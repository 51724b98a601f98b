"""Which sequences run in the next engine step: first come, first served.

Waiting sequences are admitted in arrival order while fewer than `max_running`
are running; every running sequence advances each step. (Batched forwards and a
KV memory budget come with continuous batching; this keeps the same shape.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llorch.engine.sequence import Sequence, SequenceState


@dataclass
class StepPlan:
    prefill: list[Sequence]
    decode: list[Sequence]


class Scheduler:
    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def find(self, job_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.job_id == job_id:
                return seq
        return None

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def plan(self) -> StepPlan:
        decode = [s for s in self.running if s.state is SequenceState.RUNNING]
        prefill: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            self.running.append(seq)
            prefill.append(seq)
        return StepPlan(prefill=prefill, decode=decode)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)
