"""Ray Serve's request router for engine replicas: prefix affinity first, then the least loaded.

It runs inside the front's process (one per deployment handle) and reads the `RelayedRequest`
each call carries:
- `pin` sends the call to that replica only (a job's /cancel, a replica's /health or /metrics);
- `avoid` skips replicas that already answered busy for this request (while others remain);
- otherwise the replica that read the longest prefix of the prompt goes first, unless it has
  `imbalance` more requests in flight than the least loaded; the others follow, least loaded first.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from llorch.replicas.affinity import PrefixAffinity
from llorch.replicas.directory import publish
from llorch.replicas.relay import RelayedRequest


def _relayed(pending: PendingRequest | None) -> RelayedRequest | None:
    if pending is None:
        return None
    return next((a for a in pending.args if isinstance(a, RelayedRequest)), None)


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4) -> None:
        self.imbalance = imbalance
        self.affinity = PrefixAffinity()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # no busy loop while every replica is full
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        call = _relayed(pending_request)
        if call is not None and call.pin is not None:
            return [[by_id[call.pin]]] if call.pin in by_id else []  # gone: the caller's timeout answers
        allowed = [r for r in candidate_replicas if call is None or r.replica_id.unique_id not in call.avoid]
        allowed = allowed or list(candidate_replicas)
        others = self._least_loaded_first(allowed)
        if call is None or not call.routing_text:
            return [others]
        owner, _ = self.affinity.lookup(call.routing_text, {r.replica_id.unique_id for r in allowed})
        if owner is None or self._overloaded(by_id[owner], allowed):
            return [others]
        return [[by_id[owner]], [r for r in others if r.replica_id.unique_id != owner]]

    def _queue_len(self, replica: RunningReplica) -> int:
        known = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if known is None else known

    def _least_loaded_first(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        shuffled = random.sample(replicas, len(replicas))  # ties go to a random replica
        return sorted(shuffled, key=self._queue_len)

    def _overloaded(self, replica: RunningReplica, allowed: list[RunningReplica]) -> bool:
        return self._queue_len(replica) - min(self._queue_len(r) for r in allowed) > self.imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        call = _relayed(pending_request)
        if call is not None and call.pin is None and call.routing_text:
            self.affinity.record(call.routing_text, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)
        self._publish()

    def _publish(self) -> None:
        publish(self._deployment_id.name, [r.unique_id for r in self.curr_replicas])
