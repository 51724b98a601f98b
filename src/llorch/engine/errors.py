"""Why the engine refuses a job before it starts. Each API maps these to its own error shape
(llorch.api.errors), in one place."""

from __future__ import annotations


class EngineRefusal(Exception):
    """Base of the refusals below."""


class RequestRejected(EngineRefusal):
    """A well-formed request that cannot be served as asked: a 400 naming the field.

    `code` is a short machine-readable reason (OpenAI's error `code`).
    """

    def __init__(self, field: str, constraint: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.field, self.constraint, self.message, self.code = field, constraint, message, code


class DuplicateJob(EngineRefusal):
    """A job_id that is already queued or running (a 409)."""


class QueueFull(EngineRefusal):
    """The worker already holds as many queued jobs as it accepts (a 503 with Retry-After)."""
