"""Ends this process as soon as its parent process ends, while it is busy in work that cannot look: loading
a model.

The engine core and its tensor-parallel workers check for their parent between steps, but loading a model
takes minutes for a large one (or blocks on a slow disk), and a frontend killed meanwhile (SIGKILL, the OOM
killer) would leave its core loading to the end, holding the GPU memory a restarted server needs:

    with ParentWatch(parent_pid, on_gone=remove_sockets):
        core = EngineCore(config)  # the parent ends here: on_gone(), then os._exit(0) from the watch's thread

The watch waits on a pidfd of the parent (Linux 5.3+), or else looks at `os.getppid()` every
`POLL_SECONDS`. It is disarmed when the block ends.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable
from types import TracebackType

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # without a pidfd


class ParentWatch:
    """A daemon thread that, once the process `parent_pid` has ended, calls `on_gone` and exits the process
    with status 0 (no cleanup runs: the work it interrupts holds no state worth saving)."""

    def __init__(self, parent_pid: int, on_gone: Callable[[], None], what: str) -> None:
        self.parent_pid = parent_pid
        self.on_gone = on_gone
        self.what = what  # for the log: "loading the model"
        self._ended = _pidfd(parent_pid)
        self._stop_read, self._stop_write = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="sluice-parent-watch", daemon=True)

    def __enter__(self) -> ParentWatch:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        os.write(self._stop_write, b"x")
        self._thread.join()
        for fd in (self._stop_read, self._stop_write, self._ended):
            if fd is not None:
                os.close(fd)

    def _watch(self) -> None:
        waited = [self._stop_read] if self._ended is None else [self._stop_read, self._ended]
        timeout = POLL_SECONDS if self._ended is None else None
        while os.getppid() == self.parent_pid:  # a pidfd opened after the parent ended names another process
            readable, _, _ = select.select(waited, [], [], timeout)
            if self._stop_read in readable:
                return
            if self._ended in readable:
                break
        logger.warning("the parent process (pid %d) ended while %s; exiting", self.parent_pid, self.what)
        try:
            self.on_gone()
        finally:
            logging.shutdown()
            os._exit(0)


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when `pid` ends, where the platform has them."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
