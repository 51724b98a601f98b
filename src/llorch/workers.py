"""The three worker programs. Each is hard-wired to one backend; none falls back.

Start-up: backend -> device check -> the weights' memory faulting in (on a warm start, the
weights read into it, or mapped) -> HTTP server accepting (health says loading) -> model load ->
residency check -> engine -> ready callback -> serve until SIGINT/SIGTERM; a warm start's model
load runs beside the imports, before the server accepts. This module imports only what
parsing the flags needs: the engine's and the web stack's ~0.6 s of imports run while threads
fault in the memory the weights are read into (weights.arena) and, when the conversion cache
knows the file, read them (weights.warm_read), without Python's lock; or map them, when the
cache holds their image (weights.weight_image).
An expected failure before serving is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llorch.api.cors import parse_origins
from llorch.collector import resume_collection
from llorch.device import Backend, resolve_backend, verify_device
from llorch.engine.config import (
    DEFAULT_CPU_KV_MB,
    DEFAULT_CUDA_KV_FRACTION,
    DEFAULT_SPECULATIVE_TOKENS,
    DTYPES,
    KIND_LIMITS,
    SPECULATIVE_MODES,
    EngineConfig,
)
from llorch.errors import StartupError
from llorch.host import physical_cores
from llorch.kernels import build as kernels
from llorch.logs import setup_logging
from llorch.memory import return_large_blocks
from llorch.models.encoder_config import POOLINGS
from llorch.settings import ServingSettings
from llorch.weights.arena import drop_prepared_arena, prepare_arena
from llorch.weights.default_model import assembled_default_model

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from llorch.api.state import WorkerState

log = logging.getLogger("llorch.worker")

def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cors_origins(text: str) -> list[str] | None:
    try:
        return parse_origins(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def build_parser(program: str, backend: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program, description=f"llorch worker on the {backend} backend")
    parser.add_argument(
        "--model", help="GGUF file or Hugging Face model directory (default: the embedded Gemma 3 270M Q4_K_M)"
    )
    parser.add_argument("--worker-id", default=None, help="id sent in the ready callback")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to bind (0 picks a free one)")
    parser.add_argument("--callback-url", default=None, help="POST {worker_id, vram_bytes, uri} here when ready")
    parser.add_argument("--callback-timeout", type=float, default=30.0,
                        help="seconds to keep retrying the ready callback before exiting (default 30)")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="compute dtype")
    parser.add_argument("--ctx-size", type=int, default=None, help="max prompt+generated tokens per job")
    parser.add_argument("--api-key", default=os.environ.get("LLORCH_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $LLORCH_API_KEY)")
    parser.add_argument("--cors-origins", type=cors_origins, default=None,
                        help="origins whose web pages may call the worker: comma-separated, '*' for any, 'none' for "
                             "no cross-origin calls (default: http(s) pages on localhost and 127.0.0.1, any port)")
    parser.add_argument("--slots", action=argparse.BooleanOptionalAction, default=False,
                        help="serve llama-server's GET /slots, the jobs in flight (default off, as --no-slots)")
    parser.add_argument("--chat-template-file", default=None,
                        help="jinja2 chat template to use instead of the model's own")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads for tensor ops (default: the physical cores this process may use)")
    generate, pooled = KIND_LIMITS["generate"], KIND_LIMITS["pooled"]
    parser.add_argument("--max-running", type=positive_int, default=None,
                        help=f"most jobs batched into one forward step (default {generate[0]}; {pooled[0]} texts for "
                             "embedding and rerank models)")
    parser.add_argument("--max-queue", type=non_negative_int, default=None,
                        help=f"jobs that may wait for a slot; beyond them new jobs get 503 (default {generate[1]}; "
                             f"{pooled[1]} texts for embedding and rerank models)")
    parser.add_argument("--max-batch-tokens", type=positive_int, default=None,
                        help="prompt tokens read per step, shared by new jobs, so long prompts never "
                             f"stall running streams (default {generate[2]}; for embedding and rerank models, "
                             f"{pooled[2]} tokens of whole texts)")
    parser.add_argument("--pooling", choices=POOLINGS, default=None,
                        help="an embedding model's pooling (mean, cls, last), or rank for a reranker's "
                             "classification head (default: what the model's files say)")
    parser.add_argument("--speculative", choices=SPECULATIVE_MODES, default=None,
                        help="speculative decoding: 'ngram' proposes tokens found in the job's own text, 'draft' "
                             "a draft model's guesses; one step verifies them, which never changes the output; "
                             "default: draft with --draft-model, else ngram where the compute path is "
                             "batch-invariant (the CPU worker), else off")
    parser.add_argument("--draft-model", default=None,
                        help="a smaller model of the same vocabulary (GGUF file or Hugging Face directory) whose "
                             "greedy guesses are verified (--speculative draft, the default when given)")
    parser.add_argument("--speculative-tokens", type=positive_int, default=DEFAULT_SPECULATIVE_TOKENS,
                        help=f"proposed tokens per row and step, at most (default {DEFAULT_SPECULATIVE_TOKENS})")
    parser.add_argument("--kv-cache-mb", type=positive_int, default=None,
                        help="memory of the paged KV cache pool, allocated at start-up (default: "
                             f"{DEFAULT_CPU_KV_MB} MB on the CPU, {DEFAULT_CUDA_KV_FRACTION * 100:.0f}%% of the GPU "
                             "memory free after loading; at most --max-running full contexts)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="do not reuse KV blocks of prompt prefixes shared between jobs")
    parser.add_argument("--grammar-at-start", action="store_true",
                        help="build the grammar engine's view of the vocabulary while loading (about 1 s and "
                             "120 MB at 262k tokens) instead of on the first constrained request, whose build "
                             "holds Python's lock and so delays every other answer, /health included, once")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="refuse prompts longer than this many tokens (default: the context size)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="end a job still running after this many seconds with error TIMEOUT")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds to let running jobs finish (default 30)")
    parser.add_argument("--max-connections", type=positive_int, default=256,
                        help="HTTP requests answered at once (streams included) before new ones get 503; "
                             "/health and /metrics always answer; past this many open connections the "
                             "oldest idle one is closed (default 256)")
    parser.add_argument("--log-format", choices=("json", "text"), default="json")
    parser.add_argument("--log-level", default="info")
    if backend == "cuda":
        parser.add_argument("--cuda-device", type=int, default=0, help="GPU index (default 0)")
    if backend == "cpu":
        parser.add_argument("--dequantize", action="store_true",
                            help="hold GGUF weights dequantized in the compute dtype instead of the file's blocks "
                                 "(more memory, slower decode; the file's exact numbers)")
    return parser


def advertised_host(host: str) -> str:
    return socket.gethostname() if host in ("0.0.0.0", "::") else host


def failure_line(program: str, message: str) -> str:
    """The one line an expected start-up failure prints (no traceback)."""
    return f"{program}: error: {message}"


def report_failure(program: str, message: str) -> None:
    print(failure_line(program, message), file=sys.stderr)


def run_worker(backend_name: str, argv: list[str] | None = None) -> int:
    program = f"llorch-{backend_name}-worker"
    args = build_parser(program, backend_name).parse_args(argv)
    settings = ServingSettings.from_args(backend_name, args)
    setup_logging(settings.log_format, settings.log_level)
    process_start = time.perf_counter()
    try:
        backend = open_backend(settings)
    except StartupError as exc:
        report_failure(program, str(exc))
        return exc.exit_code
    warm = prepare_weights_memory(settings.engine, backend.device)
    from llorch.api.state import WorkerState

    state = WorkerState(backend=backend.name, device=str(backend.device))
    # A warm start loads while the web stack imports: its load is C calls that leave Python's lock (a first
    # start's conversion holds it for seconds, and loads once the server accepts, in Lifecycle.run).
    loading = Loading(settings, backend, state, beside_imports=True) if warm else None
    # The web stack and the event loop, imported while the arena faults in (and a warm start loads).
    import uvloop

    from llorch.api.app import create_app

    app = create_app(state, settings.api_key, settings.origins, slots=settings.slots)
    import uvicorn  # noqa: F401  (the last of the imports: Lifecycle.run serves with it)

    resume_collection()
    worker_id = args.worker_id or f"{program}-{socket.gethostname()}-{os.getpid()}"
    lifecycle = Lifecycle(program, args, settings, backend, state, worker_id, process_start, loading)
    try:
        # uvloop: the event loop's own work per streamed token (wake-up, socket write) is about half
        # of asyncio's, and on a 2-core machine that time is taken from the step's threads.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(lifecycle.run(app))
    finally:
        if state.engine is not None:
            state.engine.stop()


def open_backend(settings: ServingSettings) -> Backend:
    """The program's hard-wired backend with its threads set and its device proven, or StartupError.

    Checked before anything else, so a missing backend fails at once (a Ray replica builds its
    engine through here too)."""
    return_large_blocks()  # before anything large is allocated
    backend = resolve_backend(settings.backend, settings.cuda_device)
    if backend.device == "cpu":
        kernels.start_building()  # the C kernels, while the server binds and the model's files are read
    kernels.set_threads(settings.threads or physical_cores())  # torch's too, where a compute path uses torch
    verify_device(backend.device)
    return backend


def prepare_weights_memory(config: EngineConfig, device: str) -> bool:
    """A GGUF file the C step serves is read into one huge-page arena (weights.arena): have it faulted in
    while the program imports, and on a warm start read into it too (weights.warm_read), or its image
    mapped instead. A file loaded another way (an embedding model) drops both unused. Whether the warm
    read began (the conversion cache knows the file)."""
    if not config.c_step_on(device):
        return False
    path = Path(config.model) if config.model else assembled_default_model()
    if path is None or path.suffix != ".gguf" or not path.is_file():
        return False
    if config.pooling == "last":  # last-token embeddings come from torch's hidden states
        prepare_arena(path.stat().st_size)
        return False
    from llorch.weights.warm_read import start_warm_read

    return start_warm_read(path)  # it prepares the arena too, unless the matrices' image maps instead


def load_engine(settings: ServingSettings, backend: Backend, state: WorkerState, beside_imports: bool) -> None:
    """Build the engine from the settings, start it and attach it to `state` (runs in a worker thread).

    `beside_imports`: a warm start's load, while the main thread imports the web stack. Its probe forward
    (factory.prove_finite_logits) then leaves that thread a core: on as many threads as cores, the step's
    threads and the importing one took turns, and a thread waiting for its core held the others at the
    step's barriers (the 1.1B's probe of 16 tokens: 0.09 s alone, 0.18-0.54 s beside a busy Python thread
    on 2 threads, 0.17-0.26 s on 1)."""

    def progress(done: int, total: int) -> None:
        state.loading_progress = done / total

    from llorch.engine.factory import build_engine
    from llorch.weights.warm_read import drop_warm_read

    try:
        probe_threads = max(kernels.threads() - 1, 1) if beside_imports and backend.device == "cpu" else None
        engine = build_engine(settings.engine, backend.device, telemetry=state.telemetry, progress=progress,
                              probe_threads=probe_threads)
    finally:
        drop_prepared_arena()
        drop_warm_read()
    engine.start()
    state.attach(engine)


class Loading:
    """load_engine in a thread of its own that ends with it; wait() raises its errors.

    Loading runs OpenMP regions (torch's, the kernels' repacking); OpenMP keeps a pool of
    threads for every thread that ran one, for as long as that thread lives. Had a long-lived
    thread loaded the model, its idle pool would outlive the load, and with more OpenMP
    threads than cores the runtime stops spinning at its barriers and sleeps instead: each
    decode step, run on the engine thread with a pool of its own, took twice as long
    (about 10 ms more per token on the default model with 2 threads on 2 cores). A thread that
    ends takes its pool with it.
    """

    def __init__(self, settings: ServingSettings, backend: Backend, state: WorkerState, beside_imports: bool) -> None:
        # What the load imports, imported here first: two threads importing the same modules at once
        # can deadlock on their import locks, and a warm start's load runs beside the web stack's imports.
        import multiprocessing.synchronize  # noqa: F401  (the chat template's helper process)

        import llorch.engine.factory  # noqa: F401

        self._failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(settings, backend, state, beside_imports),
                                        name="llorch-load", daemon=True)
        self._thread.start()

    def _run(self, settings: ServingSettings, backend: Backend, state: WorkerState, beside_imports: bool) -> None:
        try:
            load_engine(settings, backend, state, beside_imports)
        except BaseException as exc:  # raised again by wait()
            self._failure.append(exc)

    def wait(self) -> None:
        self._thread.join()
        if self._failure:
            raise self._failure[0]


class Lifecycle:
    """bind -> load, or wait for a warm start's (health says loading) -> ready callback -> serve -> drain on
    SIGTERM/SIGINT -> exit."""

    def __init__(self, program: str, args: argparse.Namespace, settings: ServingSettings, backend: Backend,
                 state: WorkerState, worker_id: str, process_start: float, loading: Loading | None = None) -> None:
        self.program, self.args, self.settings, self.backend, self.state = program, args, settings, backend, state
        self.worker_id, self.process_start = worker_id, process_start
        self.loading = loading  # a warm start's load, begun before the server
        self.server: uvicorn.Server | None = None
        self.drain_task: asyncio.Task[None] | None = None

    async def run(self, app: FastAPI) -> int:
        import uvicorn

        from llorch.api.callback import send_ready
        from llorch.api.connections import RequestLimit, guarded_protocol

        args = self.args
        # The request limit and the idle-connection bound are ours (api/connections.py): uvicorn's
        # limit_concurrency counts idle connections, so slow clients could lock everyone out.
        # No WebSocket protocol and no lifespan events: the API has neither, and their set-up (importing a
        # WebSocket library) came on the start's path.
        config = uvicorn.Config(RequestLimit(app, args.max_connections), host=args.host, port=args.port,
                                http=guarded_protocol(args.max_connections), ws="none", lifespan="off",
                                log_config=None, access_log=False, timeout_graceful_shutdown=5)
        server = self.server = uvicorn.Server(config)

        async def serve() -> None:
            with contextlib.suppress(SystemExit):  # uvicorn exits when it cannot bind: the line below says why
                await server.serve()

        task = asyncio.create_task(serve())
        while not server.started:
            if task.done():
                report_failure(self.program, f"could not serve on {args.host}:{args.port}")
                return 1
            await asyncio.sleep(0.02)
        self.install_signal_handlers()
        port = server.servers[0].sockets[0].getsockname()[1]
        uri = f"http://{advertised_host(args.host)}:{port}"
        log.info("listening; loading the model", extra={"uri": uri})
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("listening beyond loopback", extra={"host": args.host, "auth": bool(args.api_key)})

        try:
            # After binding: a first start converts the model in Python for seconds, which would starve the
            # server's start of Python's lock.
            loading = self.loading or Loading(self.settings, self.backend, self.state, beside_imports=False)
            await asyncio.to_thread(loading.wait)
        except StartupError as exc:
            report_failure(self.program, str(exc))
            await self.stop_server(task)
            return exc.exit_code
        if self.state.draining:  # told to stop while loading
            await self.stop_server(task)
            return 0
        engine = self.state.engine
        assert engine is not None
        log.info("worker ready", extra={"uri": uri, "worker_id": self.worker_id,
                                        "start_to_ready_s": round(time.perf_counter() - self.process_start, 3)})
        if args.callback_url:
            payload = {"worker_id": self.worker_id, "vram_bytes": engine.resident_bytes, "uri": uri}
            if not await send_ready(args.callback_url, payload, args.callback_timeout):
                log.error("ready callback never succeeded; exiting", extra={"url": args.callback_url})
                await self.stop_server(task)
                return 1
        await task
        if self.drain_task is not None:
            await self.drain_task
        return 0

    async def stop_server(self, task: asyncio.Task[None]) -> None:
        assert self.server is not None
        self.server.should_exit = True
        await task

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.begin_drain, signum)

    def begin_drain(self, signum: int) -> None:
        if self.drain_task is not None:
            return
        log.info("draining", extra={"signal": signal.Signals(signum).name, "timeout_s": self.args.drain_timeout})
        self.state.draining = True
        self.drain_task = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        """Refuse new jobs, let running ones finish for --drain-timeout, cancel the rest, stop."""
        engine = self.state.engine
        if engine is not None:
            deadline = time.monotonic() + self.args.drain_timeout
            while engine.jobs_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if engine.jobs_in_flight:
                log.warning("drain timeout; cancelling the remaining jobs", extra={"jobs": engine.jobs_in_flight})
                engine.abort_all("the worker is shutting down")
                while engine.jobs_in_flight:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # let the last terminal events reach their streams
        assert self.server is not None
        self.server.should_exit = True
