"""The driver's watch over its worker processes: one thread, woken by events only.

It waits (one poll) on every worker's process sentinel (readable the moment the process exits, however it
died) and on the results socket (WorkerStarted / WorkerReady / WorkerFailed). The first failure, a worker
that exited or said it failed, is kept as a `WorkerFailure` with the monotonic time it was noticed; the
driver raises it at its next call (or when a collective fails because of it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import zmq

from sluice.engine.executor.messages import WorkerFailed, WorkerReady, WorkerStarted, decode_worker_message

logger = logging.getLogger(__name__)

# After a worker's exit, how long its last message (WorkerFailed, sent before exiting) may take to arrive.
LAST_MESSAGE_SECONDS = 0.2


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited or failed: the engine cannot run another step."""


@dataclass(frozen=True)
class WorkerFailure:
    rank: int
    pid: int | None
    reason: str  # "exited (killed by SIGKILL)", "failed: RuntimeError: ..."
    noticed_at: float  # time.monotonic() in the driver's process when the monitor saw it

    def error(self) -> WorkerDiedError:
        return WorkerDiedError(
            f"tensor-parallel rank {self.rank} (pid {self.pid}) {self.reason}; "
            f"noticed at monotonic {self.noticed_at:.3f}"
        )


class WorkerMonitor(threading.Thread):
    """Watches `processes` (rank -> process) and the `results` socket (which it alone reads).

    `wait_for(predicate)` blocks the caller until predicate() holds, a worker failed (raises its error) or
    `timeout` passes. `failure` is set once, by this thread.
    """

    def __init__(self, processes: dict[int, BaseProcess], results: zmq.Socket) -> None:
        super().__init__(name="sluice-tp-worker-monitor", daemon=True)
        self.processes = processes
        self.results = results
        self.started: dict[int, int] = {}  # rank -> pid
        self.ready: dict[int, WorkerReady] = {}
        self.failure: WorkerFailure | None = None
        self._errors: dict[int, str] = {}
        self._changed = threading.Condition()
        self._stopping = False
        self._wake_read, self._wake_write = os.pipe()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        sentinels = {process.sentinel: rank for rank, process in self.processes.items()}
        for sentinel in sentinels:
            poller.register(sentinel, zmq.POLLIN)
        while self.failure is None:
            events = dict(poller.poll())
            if self._wake_read in events:
                return
            self._receive()
            exited = [rank for sentinel, rank in sentinels.items() if sentinel in events]
            if exited:
                self._receive(LAST_MESSAGE_SECONDS)  # its WorkerFailed, if it sent one
                self._fail(exited[0])
            elif self._errors:
                self._fail(next(iter(self._errors)))

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float) -> None:
        """Blocks until predicate() (evaluated under the monitor's lock) holds. Raises the failure's
        `WorkerDiedError`, or TimeoutError naming `what`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                if self.failure is not None:
                    raise self.failure.error()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"tensor-parallel workers: no {what} within {timeout:.0f}s")
                self._changed.wait(left)

    def notify(self) -> None:
        """Wakes `wait_for` callers to check their predicate again, after a change this thread does not
        see (rank 0's own join of the group ended)."""
        with self._changed:
            self._changed.notify_all()

    def stop(self) -> None:
        """Ends the thread (workers exiting from now on are not failures)."""
        self._stopping = True
        os.write(self._wake_write, b"x")
        if self.is_alive():
            self.join()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _receive(self, wait_seconds: float = 0.0) -> None:
        """Handles every message queued now (or arriving within `wait_seconds`)."""
        while self.results.poll(int(wait_seconds * 1000)):
            message = decode_worker_message(self.results.recv())
            with self._changed:
                if isinstance(message, WorkerStarted):
                    self.started[message.rank] = message.pid
                elif isinstance(message, WorkerReady):
                    self.ready[message.rank] = message
                elif isinstance(message, WorkerFailed):
                    self._errors[message.rank] = message.error
                self._changed.notify_all()

    def _fail(self, rank: int) -> None:
        if self._stopping:
            return
        process = self.processes[rank]
        if rank in self._errors:
            reason = f"failed: {self._errors[rank]}"
        else:
            process.join(0)
            reason = f"exited ({_exit_reason(process.exitcode)})"
        failure = WorkerFailure(rank, process.pid, reason, time.monotonic())
        logger.error("%s", failure.error())
        with self._changed:
            self.failure = failure
            self._changed.notify_all()


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"
