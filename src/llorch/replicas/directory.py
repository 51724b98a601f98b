"""Which engine replicas the routers in this process can reach, by deployment name.

The front asks every replica for its /health and /metrics; Ray Serve has no public call that lists
a deployment's replicas, but the request router is told of each change. This lives apart from the
router because Ray ships the router's own module to each process by value (a copy of its globals),
while this module is imported, once per process, by the router and the front alike.
"""

from __future__ import annotations

import threading

_known: dict[str, list[str]] = {}
_lock = threading.Lock()


def publish(deployment: str, replicas: list[str]) -> None:
    with _lock:
        _known[deployment] = sorted(replicas)


def known_replicas(deployment: str) -> list[str]:
    with _lock:
        return list(_known.get(deployment, []))
