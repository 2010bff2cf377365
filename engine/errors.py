"""Errors the engine raises to its callers; the gRPC edge maps each to one status code."""

from __future__ import annotations


class SluiceError(Exception):
    """Base class of every error Sluice raises on purpose."""


class InvalidRequestError(SluiceError, ValueError):
    """A request field is malformed. `field` names it (maps to INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ContextLengthError(InvalidRequestError):
    """prompt + max_tokens does not fit the model's context, or the KV cache (maps to RESOURCE_EXHAUSTED)."""


class QueueFullError(SluiceError):
    """The waiting queue is at its bound (maps to RESOURCE_EXHAUSTED, with `retry_pushback_ms` in the
    `grpc-retry-pushback-ms` trailer and, for `StreamGenerate`'s in-band errors, in the message)."""

    retry_pushback_ms = 1000  # the queue drains as requests finish: a short fixed hint


class UnknownRequestError(InvalidRequestError):
    """No request has this id (maps to NOT_FOUND)."""

    def __init__(self, request_id: str) -> None:
        super().__init__("request_id", f"no request with id {request_id!r}")


class EngineDeadError(SluiceError):
    """The engine core died (exited, failed a step, stopped answering); nothing more can be served
    here (maps to UNAVAILABLE, so clients retry on another replica)."""
