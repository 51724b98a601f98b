"""Errors that end start-up with one clear line instead of a traceback."""

from __future__ import annotations

from pathlib import Path


class StartupError(Exception):
    """An expected failure before the worker serves: printed as one line, exit non-zero."""

    exit_code = 1


class ModelFileError(StartupError):
    """A model file that is missing, corrupt, or describes something we cannot load."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class BackendUnavailable(StartupError):
    """The worker's hard-wired backend does not exist on this machine."""

    exit_code = 2
