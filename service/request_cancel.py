"""RequestCancel: ends one request early from outside its stream (Abort RPC, its timeout), at any
point of its life: before it reaches the engine (it then never does), or while the engine runs it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

ABORT = "abort"
TIMEOUT = "timeout"


class RequestCancel:
    """`reason` is None until `cancel(reason)`; the first reason wins, later calls change nothing."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._listener: Callable[[], Awaitable[None]] | None = None

    @property
    def cancelled(self) -> bool:
        return self.reason is not None

    def attach(self, listener: Callable[[], Awaitable[None]]) -> None:
        """`listener()` aborts the engine request; awaited by the first `cancel` after this."""
        self._listener = listener

    async def cancel(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        if self._listener is not None:
            await self._listener()
