"""An engine decoding greedy windows in a process of its own, for benchmarks that take engines in turn.

    python bench/decoders.py ENGINE MODEL --threads N --window W [--context C]   # one engine's side

Each engine (llorch's runner as the worker feeds it, or llama.cpp through its Python bindings) loads
its own copy of the model in its own process, says `ready` (with llorch, and the prompt's text after
BOS as JSON, which a worker can be sent), then for each line it reads decodes `window` greedy tokens
and answers the seconds they took. Every window starts again from the prompt's end (its keys and
values overwritten), so that each runs at the context its row names: a prompt of `context` tokens
(BOS alone for 1 or less, the weight-bound case; otherwise the first `context` tokens of
context_text, which begins with speed.py's prompt).

Why a process each: a row's windows then run on a process holding nothing but that engine, whatever
the rows before it left behind. In speed.py's own process, after its other rows, our windows on the
1.1B file measured 30.3 tok/s in the hour that it decoded at 35.0 over HTTP at the same positions and
at 36.1 here (Zen 3, two threads). What the earlier rows left is not known: beside llama.cpp's
bindings alone, with no row before, the two placements measured level (24 windows in turn on that
machine: 96% and 97% of the roofline)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def context_text() -> str:
    """Ordinary English text of some 8,000 tokens: a prompt of N tokens is its first N (speed.py's the first 512)."""
    return " ".join(f"Item {i} of the inventory is a box of {i % 7 + 2} red apples." for i in range(600))


class Decoder:
    """One engine's process, its windows asked for one at a time; `tree` is the llorch checkout it imports."""

    def __init__(self, engine: str, model: Path, threads: int, window: int, context: int = 1,
                 tree: Path = HERE.parent) -> None:
        self.window = window
        command = [sys.executable, str(HERE / "decoders.py"), engine, str(model), "--threads", str(threads),
                   "--window", str(window), "--context", str(context)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, "PYTHONPATH": f"{tree / 'src'}:{HERE}"}, cwd=str(HERE))

    def ready(self) -> Any:
        """Wait for the load; the prompt's text after BOS (llorch) or None. Raises if the process failed."""
        assert self.process.stdout is not None
        word, _, rest = self.process.stdout.readline().partition(" ")
        if word.strip() != "ready":
            raise RuntimeError(f"the decoder failed to load, exit code {self.process.poll()} (its output is above)")
        return json.loads(rest) if rest.strip() else None

    def tokens_per_s(self) -> float:
        """One window's decode rate."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return self.window / float(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def windows_in_turn(engines: dict[str, Decoder], windows: int,
                    probe: Callable[[], float]) -> dict[str, list[tuple[float, float, float]]]:
    """`windows` windows of each engine in turn, a read `probe` between every two; per engine, each window's
    (tokens/s, the probe before it, the probe after it). The engines are closed when it returns or fails."""
    try:
        for decoder in engines.values():
            decoder.ready()
        taken: dict[str, list[tuple[float, float, float]]] = {name: [] for name in engines}
        before = probe()
        for _ in range(windows):
            for name, decoder in engines.items():
                rate = decoder.tokens_per_s()
                after = probe()
                taken[name].append((rate, before, after))
                before = after
        return taken
    finally:
        for decoder in engines.values():
            decoder.close()


def serve(engine: str, model: Path, window: int, threads: int, context: int) -> None:
    """An engine's side: load, say `ready`, then per line read decode `window` tokens and answer the seconds."""
    import speed

    tokens = max(context, 1) + window + 16  # every window at the same positions after the prompt
    if engine == "llorch":
        from llorch.engine.runner import ChunkInput
        from llorch.kernels import build
        from llorch.weights.native_loader import load_native

        served = load_native(model)
        speed.wait_for_images()
        first = served.tokenizer.encode(context_text())[:max(context, 1)]  # BOS first
        if len(first) < context:
            raise SystemExit(f"--context {context}: the prompt text has only {len(first)} tokens")
        build.set_threads(threads)
        runner, blocks = speed.decode_runner(served, tokens)
        origin = {"token": speed.greedy_token(runner, ChunkInput(first, 0, blocks, True)), "position": len(first)}
        state = dict(origin)

        def step() -> None:
            chunk = ChunkInput([state["token"]], state["position"], blocks, True)
            state["token"], state["position"] = speed.greedy_token(runner, chunk), state["position"] + 1

        said = json.dumps(served.tokenizer.decode(first[1:]))
    else:
        import llama_build

        llm = llama_build.bindings().Llama(model_path=str(model), n_ctx=tokens, n_threads=threads,
                                           n_threads_batch=threads, verbose=False)
        first = llm.tokenize(context_text().encode())[:max(context, 1)]  # the same file's BOS first
        llm.eval(first)
        origin = {"token": speed.llama_next_token(llm)}
        state = dict(origin)

        def step() -> None:
            llm.eval([state["token"]])
            state["token"] = speed.llama_next_token(llm)

        said = ""
    print("ready", said, flush=True)
    for _ in sys.stdin:
        state.update(origin)  # back to the prompt's end: the window's positions again
        if engine != "llorch":
            llm.n_tokens = len(first)  # the next eval takes the cache back to here
        started = time.perf_counter()
        for _ in range(window):
            step()
        print(time.perf_counter() - started, flush=True)
    os._exit(0)  # llama-cpp-python's finalizers fail at interpreter exit; nothing is left to flush


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", choices=("llorch", "llama.cpp"))
    parser.add_argument("model", type=Path)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--window", type=int, required=True)
    parser.add_argument("--context", type=int, default=1)
    args = parser.parse_args()
    serve(args.engine, args.model, args.window, args.threads, args.context)


if __name__ == "__main__":
    main()
