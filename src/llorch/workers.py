"""The three worker programs. Each is hard-wired to one backend; none falls back.

Start-up: backend -> device check -> model load -> residency check -> engine ->
HTTP server accepting -> ready callback -> serve until SIGINT/SIGTERM.
An expected failure before serving is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch
import uvicorn

from llorch.api.app import WorkerInfo, create_app
from llorch.api.callback import send_ready
from llorch.device import resolve_backend, verify_device
from llorch.engine.engine import Engine
from llorch.engine.runner import ModelRunner
from llorch.errors import StartupError
from llorch.logs import setup_logging
from llorch.weights.chat_template import ChatTemplate, ChatTemplateError
from llorch.weights.default_model import default_model_path
from llorch.weights.loader import LoadedModel, load_model

log = logging.getLogger("llorch.worker")

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def build_parser(program: str, backend: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program, description=f"llorch worker on the {backend} backend")
    parser.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M Q4_K_M)")
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
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for tensor ops")
    parser.add_argument("--max-running", type=int, default=4, help="jobs advanced concurrently")
    parser.add_argument("--log-format", choices=("json", "text"), default="json")
    parser.add_argument("--log-level", default="info")
    if backend == "cuda":
        parser.add_argument("--cuda-device", type=int, default=0, help="GPU index (default 0)")
    return parser


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice != "auto":
        return DTYPES[choice]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def advertised_host(host: str) -> str:
    return socket.gethostname() if host in ("0.0.0.0", "::") else host


def run_worker(backend_name: str, argv: list[str] | None = None) -> int:
    program = f"llorch-{backend_name}-worker"
    args = build_parser(program, backend_name).parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    process_start = time.perf_counter()
    try:
        backend = resolve_backend(backend_name, getattr(args, "cuda_device", 0))
        if args.threads:
            torch.set_num_threads(args.threads)
        verify_device(backend.device)
        model_path = args.model or default_model_path()
        dtype = resolve_dtype(args.dtype, backend.device)
        loaded = load_model(model_path, backend.device, dtype)
        ctx_size = args.ctx_size or loaded.config.context_length
        if not 0 < ctx_size <= loaded.config.context_length:
            raise StartupError(
                f"--ctx-size {ctx_size} is outside 1..{loaded.config.context_length} (the model's context)"
            )
        runner = ModelRunner(loaded.model, backend.device, dtype)
        chat_template = load_chat_template(args.chat_template_file, loaded)
    except StartupError as exc:
        print(f"{program}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    log.info("model loaded", extra={"model": loaded.name, "path": str(loaded.path), "device": str(backend.device),
                                    "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                                    "seconds": round(time.perf_counter() - process_start, 3)})

    engine = Engine(runner, loaded.tokenizer, loaded.name, ctx_size, max_running=args.max_running)
    engine.start()
    info = WorkerInfo(backend=backend.name, device=str(backend.device), model=loaded.name,
                      model_id=loaded.model_id)
    app = create_app(engine, info, chat_template, args.api_key)
    worker_id = args.worker_id or f"{program}-{socket.gethostname()}-{os.getpid()}"
    try:
        return asyncio.run(serve(app, args, worker_id, engine, info, process_start))
    finally:
        engine.stop()


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


async def serve(app, args: argparse.Namespace, worker_id: str, engine: Engine,  # type: ignore[no-untyped-def]
                info: WorkerInfo, process_start: float) -> int:
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            print(f"llorch-{info.backend}-worker: error: could not serve on {args.host}:{args.port}",
                  file=sys.stderr)
            return 1
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    uri = f"http://{advertised_host(args.host)}:{port}"
    log.info("worker ready", extra={"uri": uri, "worker_id": worker_id,
                                    "start_to_ready_s": round(time.perf_counter() - process_start, 3)})
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening beyond loopback", extra={"host": args.host, "auth": bool(args.api_key)})
    if args.callback_url:
        payload = {"worker_id": worker_id, "vram_bytes": engine.runner.resident_bytes, "uri": uri}
        if not await send_ready(args.callback_url, payload, args.callback_timeout):
            log.error("ready callback never succeeded; exiting", extra={"url": args.callback_url})
            server.should_exit = True
            await task
            return 1
    await task
    return 0


def cpu_main() -> None:
    sys.exit(run_worker("cpu"))


def cuda_main() -> None:
    sys.exit(run_worker("cuda"))


def accelerate_main() -> None:
    sys.exit(run_worker("accelerate"))
