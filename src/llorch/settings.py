"""What a worker's flags decide about one engine and its HTTP app, parsed once.

A worker program builds it from its command line; the Ray launcher builds it once for
every replica, which receives it as is (it pickles) instead of parsing a command line again.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from llorch.engine.config import EngineConfig


@dataclass(frozen=True)
class ServingSettings:
    backend: str  # cpu | cuda | accelerate: the program's hard-wired backend
    engine: EngineConfig
    threads: int | None  # None: the physical cores this process may use
    cuda_device: int
    api_key: str | None
    cors_origins: tuple[str, ...] | None  # None: pages on localhost (api/cors.py)
    slots: bool
    max_connections: int
    log_format: str
    log_level: str

    @classmethod
    def from_args(cls, backend: str, args: argparse.Namespace) -> ServingSettings:
        origins = args.cors_origins
        return cls(backend=backend, engine=EngineConfig.from_args(args), threads=args.threads,
                   cuda_device=getattr(args, "cuda_device", 0), api_key=args.api_key,
                   cors_origins=tuple(origins) if origins is not None else None, slots=args.slots,
                   max_connections=args.max_connections, log_format=args.log_format, log_level=args.log_level)

    @property
    def origins(self) -> list[str] | None:
        return list(self.cors_origins) if self.cors_origins is not None else None
