"""What the HTTP side knows of the worker; the engine is attached once the model has loaded."""

from __future__ import annotations

from dataclasses import dataclass, field

from llorch.engine.engine import Engine
from llorch.engine.telemetry import Telemetry


@dataclass
class WorkerState:
    backend: str
    device: str
    telemetry: Telemetry = field(default_factory=Telemetry)
    engine: Engine | None = None
    loading_progress: float = 0.0
    draining: bool = False

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self.loading_progress = 1.0

    @property
    def model(self) -> str:
        return self.engine.model_name if self.engine else ""

    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.engine is None:
            return "loading"
        return "healthy" if self.engine.alive else "unhealthy"

    def unavailable(self) -> str | None:
        """Why jobs cannot be taken now, or None when they can."""
        if self.draining:
            return "the worker is shutting down"
        if self.engine is None:
            return "the model is still loading"
        return None
