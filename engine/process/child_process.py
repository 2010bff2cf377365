"""A child process that the event loop can await, started with `subprocess.Popen` rather than the loop's own
`create_subprocess_exec`.

uvloop (the frontend's loop) spawns with fork(), then, in the child and before exec, takes the GIL and runs
Python's after-fork handling (`PyOS_AfterFork_Child`: threading's reinitialisation and every
`os.register_at_fork` hook) in a copy of a process whose other threads (gRPC's, its completion-queue poller)
may hold locks the copy will never see released. fork() also runs every library's `pthread_atfork`
handlers in the frontend itself: gRPC's, which log "skipping fork() handlers" on each such start. CPython's
Popen uses vfork() and exec, and runs neither. (A CI run saw an engine core die of SIGSEGV before its first
log line, started beside a running server; 300 uvloop spawns under gRPC load did not reproduce it here.)

A daemon thread waits for the exit and hands the exit code to the loop that started the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
from collections.abc import Mapping, Sequence


class ChildProcess:
    """`await wait()` returns the exit code (negative: the signal that killed it); `returncode` is None
    while it runs. Must be created on a running event loop."""

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None) -> None:
        self._popen = subprocess.Popen(list(args), env=None if env is None else dict(env))
        self.pid = self._popen.pid
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        waiter = threading.Thread(target=self._wait_exit, args=(loop,), name=f"wait-{self.pid}", daemon=True)
        waiter.start()

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def join(self, timeout: float | None) -> int | None:
        """Blocks until it exits (the exit code) or `timeout` passes (None), for a caller off the loop
        that started it (once that loop has closed, `wait` never returns)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self._popen.wait(timeout)
        return None

    def kill(self) -> None:
        """SIGKILL, unless it has already exited."""
        if self._popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._popen.kill()

    def _wait_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        returncode = self._popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop was closed first: nobody is waiting
            loop.call_soon_threadsafe(_set_result, self._exited, returncode)


def _set_result(future: asyncio.Future[int], result: int) -> None:
    if not future.done():
        future.set_result(result)
