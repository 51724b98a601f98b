"""`llorch-ray-serve`: llorch engines as Ray Serve replicas behind one HTTP endpoint.

    llorch-ray-serve --backend cuda --replicas 4 --ray-address auto --model m.gguf --port 8000
    llorch-ray-serve --backend cpu --replicas 2 --replica-cpus 1 --port 8000

Every flag of the backend's worker program is accepted, checked here as that program checks
them, and given to each replica as parsed settings (settings.py). --host/--port place the front
(front.py): the worker's own HTTP server, with its deadlines for slow clients, relaying to Ray's
HTTP proxy on a loopback port. So Ray's proxy runs on this host, which must be the cluster's head.
Without --ray-address a local Ray cluster is started for this process and stopped with it.
SIGTERM/SIGINT remove the application (Ray lets running requests finish for --drain-timeout) and exit.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from dataclasses import dataclass, replace
from typing import Any

from llorch.engine.config import EngineConfig
from llorch.host import physical_cores
from llorch.logs import setup_logging
from llorch.replicas.front import Front
from llorch.settings import ServingSettings
from llorch.workers import build_parser, failure_line, positive_int, report_failure

log = logging.getLogger("llorch.replicas")

PROGRAM = "llorch-ray-serve"
APPLICATION = "llorch"
ENGINE_DEPLOYMENT = "llorch-engine"
GATEWAY_DEPLOYMENT = "llorch-gateway"
CONTROL_HEADROOM = 16  # requests beyond the engine's own capacity a replica takes: /health, /metrics, /cancel
ROUTER = "llorch.replicas.router:PrefixAffinityRouter"  # imported where each handle routes
NOT_FOR_REPLICAS = ("callback_url", "worker_id")  # the ready callback is the single worker's contract
HEAD_NODE_RESOURCE = "node:__internal_head__"  # the resource only Ray's head node has
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ClusterOptions:
    backend: str
    replicas: int
    replica_cpus: float
    replica_gpus: float
    replica: ServingSettings  # each replica's, parsed once here
    max_ongoing: int  # requests Ray sends one replica at once
    front_max_ongoing: int
    drain_timeout: float
    imbalance: int
    ray_address: str | None  # None: a local cluster for this process


def launcher_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM, description="llorch engines as Ray Serve replicas, one device each, behind one endpoint",
        epilog="Every flag of llorch-cpu-worker / llorch-cuda-worker is accepted too and given to each replica.")
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu", help="each replica's backend")
    parser.add_argument("--replicas", type=positive_int, default=1, help="engine replicas (default 1)")
    parser.add_argument("--replica-cpus", type=float, default=None,
                        help="CPUs Ray reserves per replica; a CPU replica runs this many threads unless "
                             "--threads says otherwise (default: cpu, the cores divided among the replicas; cuda, 1)")
    parser.add_argument("--replica-gpus", type=float, default=1.0, help="GPUs per cuda replica (default 1)")
    parser.add_argument("--ray-address", default=None,
                        help="a running Ray cluster ('auto' or host:port); default: start a local one")
    parser.add_argument("--router-imbalance", type=int, default=4,
                        help="requests in flight by which the replica holding a prompt's prefix may exceed the "
                             "least loaded before the least loaded is chosen instead (default 4)")
    return parser


def parse_options(argv: list[str] | None = None) -> tuple[ClusterOptions, argparse.Namespace]:
    """The launcher's options and the worker flags, each checked as the worker program checks them."""
    own, worker_argv = launcher_parser().parse_known_args(argv)
    program = f"llorch-{own.backend}-worker"
    worker = build_parser(program, own.backend).parse_args(worker_argv)
    for name in NOT_FOR_REPLICAS:
        if getattr(worker, name) is not None:
            raise SystemExit(failure_line(PROGRAM, f"--{name.replace('_', '-')} is for a single worker; "
                                               "Ray Serve replicas have no ready callback"))
    cpus = own.replica_cpus if own.replica_cpus is not None else (
        max(1, physical_cores() // own.replicas) if own.backend == "cpu" else 1)
    replica = ServingSettings.from_args(own.backend, worker)
    if own.backend == "cpu" and worker.threads is None:
        replica = replace(replica, threads=max(1, int(cpus)))
    limits = EngineConfig.from_args(worker).with_limits("generate")  # replicas serve generation models
    options = ClusterOptions(
        backend=own.backend, replicas=own.replicas, replica_cpus=cpus,
        replica_gpus=own.replica_gpus if own.backend == "cuda" else 0.0, replica=replica,
        max_ongoing=limits.max_running + limits.max_queue + CONTROL_HEADROOM,  # type: ignore[operator]
        front_max_ongoing=worker.max_connections, drain_timeout=worker.drain_timeout, imbalance=own.router_imbalance,
        ray_address=own.ray_address)
    return options, worker


def build_application(options: ClusterOptions):  # -> ray.serve.Application
    """The front bound to the engine deployment, ready for `serve.run`."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from llorch.replicas.engine_replica import EngineReplica
    from llorch.replicas.gateway import Gateway

    resources = {"num_cpus": options.replica_cpus}
    if options.replica_gpus:
        resources["num_gpus"] = options.replica_gpus
    engine = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=options.replicas, ray_actor_options=resources,
        max_ongoing_requests=options.max_ongoing, graceful_shutdown_timeout_s=options.drain_timeout,
        health_check_period_s=2, max_constructor_retry_count=options.replicas,
        request_router_config=RequestRouterConfig(request_router_class=ROUTER,
                                                  request_router_kwargs={"imbalance": options.imbalance}))
    front = serve.deployment(Gateway, name=GATEWAY_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=options.front_max_ongoing)
    return front.bind(engine.bind(options.replica), ENGINE_DEPLOYMENT)


def main(argv: list[str] | None = None) -> int:
    options, worker = parse_options(argv)
    setup_logging(worker.log_format, worker.log_level)
    for signum in (signal.SIGTERM, signal.SIGINT):  # at any point, stop through the `finally` below
        signal.signal(signum, _interrupt)
    try:
        return _serve(options, worker)
    except KeyboardInterrupt:
        log.info("stopped")
        return 0


def _interrupt(signum: int, _frame: Any) -> None:
    for other in (signal.SIGTERM, signal.SIGINT):  # the first signal stops; the cleanup is not interrupted
        signal.signal(other, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _serve(options: ClusterOptions, worker: argparse.Namespace) -> int:
    import ray
    from ray import serve

    try:  # bound before Ray starts: a taken port fails at once
        front = Front(worker.host, worker.port, worker.max_connections)
    except OSError as exc:
        report_failure(PROGRAM, f"could not serve on {worker.host}:{worker.port}: {exc.strerror or exc}")
        return 1
    address = options.ray_address
    try:
        # "local" starts a cluster of this command's own even where another runs on this machine
        # (with no address Ray would join that one, and replace its application).
        ray.init(address=address or "local", include_dashboard=False if address is None else None,
                 logging_level=logging.WARNING, log_to_driver=True)
        verdict: list[str] = []  # a start failure's line, printed once Ray is down
        try:
            return _serve_on_ray(options, worker, front, serve, verdict)
        finally:
            if address is None:
                serve.shutdown()
            ray.shutdown()
            # After Ray's shutdown: its log lines, which a thread of Ray's copies to stderr, may otherwise
            # be cut by this one (the line then no longer starts with the program's name).
            for line in verdict:
                report_failure(PROGRAM, line)
    finally:
        front.stop()


def _serve_on_ray(options: ClusterOptions, worker: argparse.Namespace, front: Front, serve: Any,
                  verdict: list[str]) -> int:
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if options.replica_gpus and gpus < options.replicas * options.replica_gpus:
        report_failure(PROGRAM, f"cuda backend unavailable: the Ray cluster has {gpus:g} GPU(s); "
                                f"{options.replicas} replica(s) of {options.replica_gpus:g} need "
                                f"{options.replicas * options.replica_gpus:g}")
        return 2
    if not _on_head_node(ray):
        report_failure(PROGRAM, "run this command on the Ray cluster's head host: Ray's HTTP proxy runs there, "
                                "reachable from that host only")
        return 2
    # Ray's proxy listens on loopback only: clients reach it through the front, with its deadlines.
    serve.start(proxy_location="HeadOnly", http_options={"host": LOOPBACK, "port": _free_loopback_port()})
    if not front.start(_proxy_url()):
        report_failure(PROGRAM, f"could not serve on {worker.host}:{worker.port}")
        return 1
    try:
        # Ray Serve's access log is a line per request per hop, shipped to this process: the
        # worker's own logs say what happened to each job.
        serve.run(build_application(options), name=APPLICATION, route_prefix="/",
                  logging_config={"enable_access_log": False})
    except RuntimeError as exc:
        verdict.append(_startup_reason(exc, _deployment_message(serve)))
        return 1
    log.info("serving", extra={"uri": f"http://{worker.host}:{front.port}", "replicas": options.replicas,
                               "backend": options.backend, "local_cluster": options.ray_address is None})
    code = 0
    try:
        front.wait()  # serves until a signal interrupts it
        log.error("the HTTP server stopped")
        code = 1
    except KeyboardInterrupt:
        log.info("stopping")
    # The front relays until the application is gone, so answers under way finish as Ray drains them.
    serve.delete(APPLICATION)
    return code


def _on_head_node(ray: Any) -> bool:
    here = ray.get_runtime_context().get_node_id()
    return any(node["NodeID"] == here and HEAD_NODE_RESOURCE in node["Resources"] for node in ray.nodes())


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _proxy_url() -> str:
    """Where Ray's proxy listens: as asked, or as a Serve instance already running on the cluster was
    started (Ray keeps that one's options, and only its client says which they are)."""
    from ray.serve.context import _get_global_client

    config = _get_global_client().http_config
    if config.host not in (LOOPBACK, "localhost", "::1"):
        log.warning("Ray's HTTP proxy was started earlier beyond loopback: clients reaching it there have no "
                    "deadlines", extra={"host": config.host, "port": config.port})
    host = LOOPBACK if config.host in ("0.0.0.0", "::", "localhost") else config.host
    return f"http://{host}:{config.port}" if ":" not in host else f"http://[{host}]:{config.port}"


def _deployment_message(serve: Any) -> str:
    """What Ray Serve says of the engine deployment (a failed replica's exception, when one failed)."""
    try:
        application = serve.status().applications[APPLICATION]
        return application.deployments[ENGINE_DEPLOYMENT].message
    except (KeyError, AttributeError, RuntimeError):
        return ""


def _startup_reason(exc: BaseException, deployment_message: str) -> str:
    """The replica's own one-line failure when Ray reports it, else Ray's first line."""
    for line in f"{deployment_message}\n{exc}".splitlines():
        if "llorch-" in line and ": error: " in line:
            return line[line.index("llorch-"):].strip()
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def cli() -> None:
    sys.exit(main())
