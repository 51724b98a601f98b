"""llorch engines as Ray Serve replicas, one device each, behind one front (the `ray` extra).

    client -> Ray's HTTP proxy -> Gateway (parses, routes, relays) -> EngineReplica (a whole worker app)

Each replica builds its engine and HTTP app through the worker programs' own code path and answers
relayed requests in-process, so the surface is the worker's; the front only picks the replica
(prefix affinity, then least loaded), retries a busy or vanished one, and aggregates /health and
/metrics. `relay.py` and `affinity.py` do not import Ray.
"""
