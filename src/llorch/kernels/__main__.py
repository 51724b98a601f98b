"""`python -m llorch.kernels`: build this CPU's kernels into the cache now, at set-up (`make serve` does).

A worker's first start then only loads them: compiling takes about 4 s of a first start on two
cores, beside the model's conversion. A worker started without this builds them itself, as before.
Without a compiler nothing fails here: the line says why, and the worker says it again and runs
without them.
"""

from __future__ import annotations

import sys
import time

from llorch.kernels.build import KernelUnavailable, build_library, chosen_variant


def main() -> int:
    started = time.perf_counter()
    try:
        variant = chosen_variant()
        path = build_library(variant)
    except KernelUnavailable as exc:
        print(f"llorch kernels not built: {exc}", file=sys.stderr)
        return 0
    print(f"llorch kernels ({variant.name}): {path} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
