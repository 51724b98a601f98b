"""What the HTTP side knows of the worker; the engine is attached once the model has loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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

    def health(self) -> dict[str, Any]:
        """The /health body of the contract (DESIGN.md)."""
        body: dict[str, Any] = {"status": self.status, "vram_bytes": self.engine.resident_bytes if self.engine else 0,
                                "backend": self.backend, "device": self.device, "model": self.model}
        if self.engine is None:
            body["progress"] = round(self.loading_progress, 3)
        return body

    def unavailable(self) -> str | None:
        """Why jobs cannot be taken now, or None when they can."""
        if self.draining:
            return "the worker is shutting down"
        if self.engine is None:
            return "the model is still loading"
        return None
