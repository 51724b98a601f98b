"""One Ray Serve replica: a whole llorch worker (engine and HTTP app) on the device Ray assigned.

It is built through the worker programs' own path (backend check, device proof, engine factory,
app) from the settings the launcher parsed once, so residency rules, limits and errors are the
same. Ray sets CUDA_VISIBLE_DEVICES to the replica's GPU, so `cuda:0` here is that GPU. A replica
whose backend is missing fails to start with the worker's one-line reason, which Ray logs and the
launcher prints.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from prometheus_client import generate_latest
from ray import serve

from llorch.api.app import create_app
from llorch.api.connections import RequestLimit
from llorch.api.state import WorkerState
from llorch.errors import StartupError
from llorch.logs import setup_logging
from llorch.replicas.relay import RelayedRequest, RelayedStart, answer_in_process
from llorch.settings import ServingSettings
from llorch.workers import Loading, failure_line, open_backend

log = logging.getLogger("llorch.replicas")


class ReplicaStartFailed(RuntimeError):
    """The worker's own one-line start-up failure, raised where Ray reports a replica's."""


class EngineReplica:
    def __init__(self, settings: ServingSettings) -> None:
        program = f"llorch-{settings.backend}-worker"
        setup_logging(settings.log_format, settings.log_level)
        self.replica = serve.get_replica_context().replica_id.unique_id
        try:
            backend = open_backend(settings)
            self.state = WorkerState(backend=backend.name, device=str(backend.device))
            Loading(settings, backend, self.state, beside_imports=False).wait()
        except StartupError as exc:
            message = failure_line(program, str(exc))
            log.error(message)
            raise ReplicaStartFailed(message) from None
        self.app = RequestLimit(create_app(self.state, settings.api_key, settings.origins, slots=settings.slots),
                                settings.max_connections)
        log.info("replica ready", extra={"replica": self.replica, "model": self.state.model})

    async def relay(self, request: RelayedRequest) -> AsyncIterator[RelayedStart | bytes]:
        async for item in answer_in_process(self.app, request, self.replica):
            yield item

    def health(self, _routing: RelayedRequest | None = None) -> dict[str, Any]:
        engine = self.state.engine
        return {**self.state.health(), "replica": self.replica, "pid": os.getpid(),
                "node": ray.util.get_node_ip_address(), "jobs_in_flight": engine.jobs_in_flight if engine else 0}

    def metrics(self, _routing: RelayedRequest | None = None) -> dict[str, str]:
        return {"replica": self.replica, "text": generate_latest(self.state.telemetry.registry).decode()}

    def check_health(self) -> None:
        """Ray calls this periodically; raising makes Ray replace the replica."""
        if self.state.status == "unhealthy":
            raise RuntimeError(f"replica {self.replica}: the engine loop has stopped")

    def __del__(self) -> None:
        # Ray has already waited (graceful_shutdown_timeout_s) for the requests in flight.
        engine = getattr(getattr(self, "state", None), "engine", None)
        if engine is not None:
            engine.abort_all("the replica is shutting down")
            engine.stop()
