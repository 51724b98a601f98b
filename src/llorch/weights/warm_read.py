"""A warm start's weights, read and rearranged for the kernels while the program imports.

On a warm start the conversion cache already holds the file's config and tensor table, so what
the load will read is known as soon as the flags are. The CPU worker then starts the whole read
of the C step's weights (weights.gguf_model.read_gguf_weights) on a thread of its own, into the
arena faulting in beside it (weights.arena): the read and the rearranging of the blocks are C
calls that leave Python's lock to the imports, on the other core. The load takes the result
(`take_warm_read`) instead of reading. Measured on Zen 4, 2 threads, the 1.1B file: the load's
weights phase had taken 0.35 s after the imports (0.13 s waiting for the read, 0.2 s rearranging);
now it waits 0.1 s, and start-to-healthy went 1.37 -> 1.16 s (the 3B file's 2.00 -> 1.73 s).

When the cache holds the matrices' image (weights.weight_image), the read maps it instead and the
arena is not faulted in. With the load itself begun beside the web stack's imports too (workers.py),
start-to-healthy went, alternated with llama-server in one run on Zen 4: default model 1.57 -> 1.28 s
(llama-server 1.64), the 1.1B file 2.09 -> 1.23 s (1.24), the 3B file 5.41 -> 1.54 s (3.20).

A first start (nothing cached) reads when the load comes to it, after converting the file; so
does a file whose cached table no longer fits its config (the load then reports why).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llorch.models.weight_shapes import decoder_weight_shapes
from llorch.weights.arena import prepare_arena
from llorch.weights.converted import ConversionCache, known_digest
from llorch.weights.gguf import GGUFFile
from llorch.weights.gguf_model import planned_shapes, read_gguf_weights
from llorch.weights.model_source import check_shapes
from llorch.weights.weight_image import WeightImage

log = logging.getLogger("llorch.weights")

Weights = tuple[dict[str, Any], dict[str, int]]  # entries and layouts, as read_gguf_weights gives them


@dataclass(frozen=True)
class _Read:
    path: Path
    weights: Future[Weights]  # its weights, or the error that stopped the read


_lock = threading.Lock()
_pending: list[_Read] = []  # at most one, until taken or dropped


def start_warm_read(path: Path) -> bool:
    """Start reading the C step's weights of `path` when the conversion cache knows the file; whether it did.
    The arena the read fills is faulted in meanwhile (weights.arena), unless the matrices' image maps instead."""
    try:
        digest = known_digest(path)
        meta = ConversionCache(digest).read_meta() if digest is not None else None
        image = WeightImage.beside(ConversionCache(digest).directory) if digest is not None else None
        if image is None or not image.exists():
            prepare_arena(path.stat().st_size)
        if meta is None:
            return False
        gguf = GGUFFile(path, table=meta.tensors)
        # As the load checks before it reads (a header may claim anything): when they differ, it says how.
        check_shapes(path, planned_shapes(gguf, meta.config), decoder_weight_shapes(meta.config))
    except Exception as exc:  # anything amiss is the load's to find and report
        log.debug("no warm read", extra={"path": str(path), "reason": repr(exc)})
        return False
    config = meta.config
    weights: Future[Weights] = Future()

    def run() -> None:
        try:
            weights.set_result(read_gguf_weights(gguf, config, gguf.dequantize_array, keep_quantized=True,
                                                 image=image)())
        except BaseException as exc:  # raised again by the load that takes it
            weights.set_exception(exc)

    threading.Thread(target=run, name="llorch-warm-read", daemon=True).start()
    with _lock:
        _pending[:] = [_Read(path.resolve(), weights)]
    return True


def take_warm_read(path: Path) -> Callable[[], Weights] | None:
    """What waits for the read started for `path` and gives its weights (or raises its error); None when
    none was started for this file."""
    with _lock:
        entry = _pending.pop() if _pending else None
    if entry is None:
        return None
    if entry.path != path.resolve():
        return None  # another file's: it is dropped
    return entry.weights.result


def drop_warm_read() -> None:
    """Forget a read nothing took (the model loaded another way): its memory goes once its thread ends."""
    with _lock, contextlib.suppress(IndexError):
        _pending.pop()
