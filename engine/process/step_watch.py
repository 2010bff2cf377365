"""`StepWatch`: tells the frontend, while a long step runs on the CPU, that the engine core is busy, not hung.

The core sends nothing while a step runs, and the frontend counts a core silent for `--engine-timeout`
seconds as hung (`CoreClient`). On a CPU one step may outlast that and be fine: a prefill chunk of the
step budget's 2,048 tokens took the embedded SmolLM2 17 s on one thread of a 2-core machine, and a larger
model takes proportionally longer. So while a step runs, a thread of the core's checks, every heartbeat,
whether the process used the CPU since the last check (a tenth of the interval at least: the step's
threads at work); if so it sends `CoreBusy` on a socket of its own. A step blocked on nothing that comes
(a deadlock, a stopped process) uses no CPU, stays silent and is still found hung.

On a GPU the watch stays off: a CPU thread waiting on a hung kernel spins (CUDA's default wait), which would
look like work; and a GPU's steps are short.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import zmq

from sluice.engine.messages import CoreBusy, encode

# The CPU time the process must have used over an interval for a running step to count as busy.
BUSY_CPU_SHARE = 0.1


class StepWatch:
    """`with watch.step(): core.step()` around each step; `close()` stops the thread (before the zmq
    context is terminated)."""

    def __init__(self, context: zmq.Context, results_address: str, interval_seconds: float) -> None:
        self._context = context
        self._address = results_address
        self._interval = interval_seconds
        self._step_started: float | None = None  # set by the stepping thread, read by the watch's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-step-watch", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._step_started = time.monotonic()
        try:
            yield
        finally:
            self._step_started = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        socket = self._context.socket(zmq.PUSH)  # a zmq socket belongs to one thread: this one its own
        socket.connect(self._address)
        try:
            cpu_before = time.process_time()
            while not self._stop.wait(self._interval):
                cpu = time.process_time()
                busy, cpu_before = cpu - cpu_before >= BUSY_CPU_SHARE * self._interval, cpu
                started = self._step_started
                if busy and started is not None and (running := time.monotonic() - started) >= self._interval:
                    with contextlib.suppress(zmq.Again):
                        socket.send(encode(CoreBusy(running)), zmq.NOBLOCK)
        finally:
            socket.close(linger=0)
