"""Ctrl-C between engine steps, never inside one.

A KeyboardInterrupt raised where SIGINT lands can cut the scheduler or the block pool half-way through
an update (a block out of the free queue and in no request's table): the offline `LLM` aborting its
requests afterwards found them inconsistent, and every later call failed (KeyError) or leaked blocks.
vLLM's `LLM` keeps its engine core in another process, out of the signal's way; here the engine runs in
the caller's, so the signal is held while a step runs and delivered between steps.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any


class DeferredInterrupt:
    """While entered on the main thread: SIGINT is noted, not handled where it lands; `deliver()` runs
    the handler it replaced (Python's raises KeyboardInterrupt) at a point the caller chose, and so does
    leaving the block. Elsewhere (another thread, SIGINT ignored or left to the OS) it does nothing."""

    def __init__(self) -> None:
        self._replaced: Callable[[int, FrameType | None], Any] | None = None
        self._pending: tuple[int, FrameType | None] | None = None

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                signal.signal(signal.SIGINT, self._note)
                self._replaced = handler
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._pending = (signum, frame)

    def deliver(self) -> None:
        """Runs the replaced handler now if SIGINT came since the last call."""
        if self._pending is not None and self._replaced is not None:
            pending, self._pending = self._pending, None
            self._replaced(*pending)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._replaced is not None:
            signal.signal(signal.SIGINT, self._replaced)
            if exc is None:
                self.deliver()
