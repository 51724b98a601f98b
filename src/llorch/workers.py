"""The three worker programs. Each is hard-wired to one backend; none falls back.

Start-up: backend -> device check -> model load -> residency check -> engine ->
HTTP server accepting -> ready callback -> serve until SIGINT/SIGTERM.
An expected failure before serving is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI

from llorch.api.app import WorkerState, create_app
from llorch.api.callback import send_ready
from llorch.device import Backend, physical_cores, resolve_backend, verify_device
from llorch.engine.engine import Engine
from llorch.engine.runner import BLOCK_SIZE, ModelRunner
from llorch.errors import StartupError
from llorch.kernels.build import KernelUnavailable
from llorch.kernels.build import library as kernel_library
from llorch.logs import setup_logging
from llorch.weights.chat_template import ChatTemplate, ChatTemplateError
from llorch.weights.default_model import default_model_path
from llorch.weights.loader import LoadedModel, load_model

log = logging.getLogger("llorch.worker")

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
DEFAULT_CPU_KV_MB = 512
DEFAULT_CUDA_KV_FRACTION = 0.5


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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
    parser.add_argument("--chat-template-file", default=None,
                        help="jinja2 chat template to use instead of the model's own")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads for tensor ops (default: the physical cores this process may use)")
    parser.add_argument("--max-running", type=positive_int, default=16,
                        help="most jobs batched into one forward step (default 16)")
    parser.add_argument("--max-queue", type=non_negative_int, default=64,
                        help="jobs that may wait for a slot; beyond them new jobs get 503 (default 64)")
    parser.add_argument("--max-batch-tokens", type=positive_int, default=512,
                        help="prompt tokens read per step, shared by new jobs, so long prompts never "
                             "stall running streams (default 512)")
    parser.add_argument("--kv-cache-mb", type=positive_int, default=None,
                        help="memory of the paged KV cache pool, allocated at start-up (default: "
                             f"{DEFAULT_CPU_KV_MB} MB on the CPU, {DEFAULT_CUDA_KV_FRACTION:.0%} of the GPU "
                             "memory free after loading; at most --max-running full contexts)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="do not reuse KV blocks of prompt prefixes shared between jobs")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="refuse prompts longer than this many tokens (default: the context size)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="end a job still running after this many seconds with error TIMEOUT")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds to let running jobs finish (default 30)")
    parser.add_argument("--max-connections", type=int, default=256,
                        help="concurrent HTTP connections before new ones get 503 (default 256)")
    parser.add_argument("--log-format", choices=("json", "text"), default="json")
    parser.add_argument("--log-level", default="info")
    if backend == "cuda":
        parser.add_argument("--cuda-device", type=int, default=0, help="GPU index (default 0)")
    if backend == "cpu":
        parser.add_argument("--dequantize", action="store_true",
                            help="hold GGUF weights dequantized in the compute dtype instead of int8 blocks "
                                 "(more memory, slower decode; the file's exact numbers)")
    return parser


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice != "auto":
        return DTYPES[choice]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # float32 on every CPU, measured rather than inferred from a flag: the int8 kernels compute in
    # float32 (bf16 activations were 30% slower even with AVX512-BF16), and dense weights keep the
    # file's exact numbers. `--dtype bf16` trades those numbers for dense-weight speed.
    return torch.float32


def advertised_host(host: str) -> str:
    return socket.gethostname() if host in ("0.0.0.0", "::") else host


def report_failure(program: str, message: str) -> None:
    """The one line an expected start-up failure prints (no traceback)."""
    print(f"{program}: error: {message}", file=sys.stderr)


def run_worker(backend_name: str, argv: list[str] | None = None) -> int:
    program = f"llorch-{backend_name}-worker"
    args = build_parser(program, backend_name).parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    process_start = time.perf_counter()
    try:
        # The backend is checked before anything else: a missing one exits at once.
        backend = resolve_backend(backend_name, getattr(args, "cuda_device", 0))
        torch.set_num_threads(args.threads or physical_cores())
        verify_device(backend.device)
    except StartupError as exc:
        report_failure(program, str(exc))
        return exc.exit_code
    state = WorkerState(backend=backend.name, device=str(backend.device))
    app = create_app(state, args.api_key)
    worker_id = args.worker_id or f"{program}-{socket.gethostname()}-{os.getpid()}"
    lifecycle = Lifecycle(program, args, backend, state, worker_id, process_start)
    try:
        return asyncio.run(lifecycle.run(app))
    finally:
        if state.engine is not None:
            state.engine.stop()


def load_engine(args: argparse.Namespace, backend: Backend, state: WorkerState) -> None:
    """Load the model, build the engine and attach it to `state` (runs in a worker thread)."""
    model_path = args.model or default_model_path()
    dtype = resolve_dtype(args.dtype, backend.device)

    def progress(done: int, total: int) -> None:
        state.loading_progress = done / total

    # The int8 kernels are the cpu worker's; the accelerate worker's point is Accelerate's BLAS
    # on dense weights, and the CUDA worker dequantizes to its compute dtype.
    keep_quantized = backend.name == "cpu" and not args.dequantize and quantized_kernels_available()
    loaded = load_model(model_path, backend.device, dtype, progress=progress, keep_quantized=keep_quantized)
    release_freed_memory()  # before the KV pool is allocated, or it would reuse (and keep) the freed pages
    ctx_size = args.ctx_size or loaded.config.context_length
    if not 0 < ctx_size <= loaded.config.context_length:
        raise StartupError(f"--ctx-size {ctx_size} is outside 1..{loaded.config.context_length} (the model's context)")
    block_bytes = ModelRunner.bytes_per_block(loaded.config, dtype)
    kv_bytes = kv_cache_budget(args.kv_cache_mb, backend.device)
    if args.kv_cache_mb is None:  # never more than every slot at full context (+ the padding block)
        kv_bytes = min(kv_bytes, (args.max_running * -(-ctx_size // BLOCK_SIZE) + 1) * block_bytes)
    if kv_bytes < 2 * block_bytes:
        raise StartupError(f"--kv-cache-mb {args.kv_cache_mb} is smaller than two KV blocks of this model "
                           f"({2 * block_bytes / 2**20:.2f} MB)")
    runner = ModelRunner(loaded.model, backend.device, dtype, kv_bytes)
    chat_template = load_chat_template(args.chat_template_file, loaded)
    state.telemetry.model.info({"model": loaded.name, "model_id": loaded.model_id, "backend": backend.name,
                                "device": str(backend.device), "dtype": str(dtype).removeprefix("torch.")})
    engine = Engine(runner, loaded.tokenizer, loaded.name, ctx_size, max_running=args.max_running,
                    telemetry=state.telemetry, request_timeout=args.request_timeout,
                    max_prompt_tokens=args.max_prompt_tokens, max_queue=args.max_queue,
                    max_batch_tokens=args.max_batch_tokens, prefix_caching=not args.no_prefix_cache)
    engine.start()
    state.attach(engine, loaded.name, loaded.model_id, chat_template)
    log.info("model loaded", extra={"model": loaded.name, "path": str(loaded.path), "device": str(backend.device),
                                    "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                                    "weights": "int8 blocks" if keep_quantized else "dense",
                                    "kv_pool_tokens": runner.tokens_per_pool, "kv_pool_bytes": runner.kv_bytes})


def release_freed_memory() -> None:
    """Hand the allocator's free pages back to the system once loading is done.

    Parsing a large tokenizer.json (a 262k vocabulary) leaves ~200 MB of freed
    parser memory that glibc keeps for reuse; nothing reuses it, yet it counts as
    the worker's resident memory. Trimming takes milliseconds.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim this way
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def quantized_kernels_available() -> bool:
    """Whether the int8 kernels build here; without them GGUF weights are dequantized, and the log says why."""
    try:
        kernel_library()
    except KernelUnavailable as exc:
        log.warning("int8 kernels unavailable, GGUF weights will be dequantized", extra={"reason": str(exc)})
        return False
    return True


def kv_cache_budget(megabytes: int | None, device: torch.device) -> int:
    """Bytes for the KV pool: the operator's figure, else a default for the device."""
    if megabytes is not None:
        return megabytes * 2**20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_CUDA_KV_FRACTION)
    return DEFAULT_CPU_KV_MB * 2**20


def load_chat_template(path: str | None, loaded: LoadedModel) -> ChatTemplate | None:
    """The operator's template file, else the model's own, else none (chat answers 400)."""
    source = loaded.chat_template
    if path:
        try:
            source = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise StartupError(f"{path}: cannot read the chat template ({exc.strerror})") from exc
    if source is None:
        return None
    tokenizer = loaded.tokenizer
    bos = tokenizer.token_text(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else ""
    eos = min(tokenizer.eos_token_ids, default=None)
    try:
        return ChatTemplate(source, bos, tokenizer.token_text(eos) if eos is not None else "")
    except ChatTemplateError as exc:
        raise StartupError(f"{path or loaded.path}: {exc}") from exc


class Lifecycle:
    """bind -> load (health says loading) -> ready callback -> serve -> drain on SIGTERM/SIGINT -> exit."""

    def __init__(self, program: str, args: argparse.Namespace, backend: Backend, state: WorkerState,
                 worker_id: str, process_start: float) -> None:
        self.program, self.args, self.backend, self.state = program, args, backend, state
        self.worker_id, self.process_start = worker_id, process_start
        self.server: uvicorn.Server | None = None
        self.drain_task: asyncio.Task[None] | None = None

    async def run(self, app: FastAPI) -> int:
        args = self.args
        # uvicorn counts the arriving connection itself against its limit: +1 admits exactly N.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                                timeout_graceful_shutdown=5, limit_concurrency=args.max_connections + 1)
        server = self.server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
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
            await asyncio.to_thread(load_engine, args, self.backend, self.state)
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
            payload = {"worker_id": self.worker_id, "vram_bytes": engine.runner.resident_bytes, "uri": uri}
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


def cpu_main() -> None:
    sys.exit(run_worker("cpu"))


def cuda_main() -> None:
    sys.exit(run_worker("cuda"))


def accelerate_main() -> None:
    sys.exit(run_worker("accelerate"))
