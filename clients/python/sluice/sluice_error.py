"""`SluiceError`: what the clients raise for an RPC that ended with a non-OK status."""

from __future__ import annotations

from collections.abc import Mapping

import grpc

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class SluiceError(Exception):
    """An RPC ended with a non-OK status; `code` is the grpc.StatusCode, `message` its details and
    `trailing_metadata` the server's trailers (e.g. `grpc-retry-pushback-ms` on RESOURCE_EXHAUSTED)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, trailing_metadata: Mapping[str, str | bytes] | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.trailing_metadata = dict(trailing_metadata or {})

    def __reduce__(self) -> tuple[type[SluiceError], tuple[object, ...]]:
        """Pickles with its fields (a process pool sends a worker's exception back pickled)."""
        return type(self), (self.code, self.message, self.trailing_metadata)

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> SluiceError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        return cls(code, details or "", dict(trailers or ()))

    @property
    def retry_pushback_ms(self) -> int | None:
        """How long the server asked the caller to wait before retrying, if it did."""
        value = self.trailing_metadata.get(RETRY_PUSHBACK_KEY)
        return int(value) if value is not None else None
