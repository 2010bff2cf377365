"""The driver's side of its worker processes (ranks 1..N-1): spawning them, the step broadcast, shutting down.

    steps    ZeroMQ XPUB bound on ipc://<dir>/steps: one send per step, ZeroMQ copies it to every
             subscriber. XPUB (not PUB) so the driver sees each worker's subscription arrive: no step is
             sent before every worker can receive it (a PUB drops messages to subscribers not yet joined).
    results  PULL bound on ipc://<dir>/results, read by the `WorkerMonitor` thread only.

The directory is removed once every worker has connected to both (the connections stay).

Processes start with multiprocessing's "spawn" (a fresh interpreter: no copy of the driver's threads,
sockets or CUDA context); their only argument is the encoded `WorkerSpec`. A script that builds an offline
`LLM(tensor_parallel_size=N)` must guard its top level with `if __name__ == "__main__":`, as with any spawn.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import shutil
import tempfile
import time

import zmq

from sluice.engine.config import EngineConfig
from sluice.engine.distributed.rendezvous import Rendezvous
from sluice.engine.executor.messages import StopWorkers, WorkerSpec, encode
from sluice.engine.executor.placement import Placement
from sluice.engine.executor.worker import run_worker
from sluice.engine.executor.worker_monitor import WorkerDiedError, WorkerMonitor

logger = logging.getLogger(__name__)

STOP_SECONDS = 10.0  # how long a stopped worker may take to exit before it is killed


class WorkerProcesses:
    """Ranks 1..N-1 of `config.parallel.tensor_parallel_size`, started at once; `monitor` watches them."""

    def __init__(self, config: EngineConfig, placement: Placement, rendezvous: Rendezvous) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        self.timeout = config.parallel.distributed_timeout_seconds
        self._directory = tempfile.mkdtemp(prefix="sluice-tp-")
        self._context = zmq.Context()
        self._context.setsockopt(zmq.LINGER, 0)
        self.steps = self._context.socket(zmq.XPUB)
        self.steps.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self.steps.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first of a topic
        self.steps.bind(f"ipc://{self._directory}/steps")
        results = self._context.socket(zmq.PULL)
        results.bind(f"ipc://{self._directory}/results")
        spawn = multiprocessing.get_context("spawn")
        self.processes = {}
        for rank in range(1, self.world_size):
            spec = WorkerSpec(
                rank=rank,
                world_size=self.world_size,
                config=config,
                device=str(placement.devices[rank]),
                num_threads=placement.num_threads,
                rendezvous_host=rendezvous.host,
                rendezvous_port=rendezvous.port,
                steps_address=f"ipc://{self._directory}/steps",
                results_address=f"ipc://{self._directory}/results",
            )
            process = spawn.Process(
                target=run_worker, args=(encode(spec),), name=f"sluice-tp-rank-{rank}", daemon=True
            )
            process.start()
            self.processes[rank] = process
        self.monitor = WorkerMonitor(self.processes, results)
        self.monitor.start()
        self._closed = False
        self.abandoned: str | None = None  # why the workers were stopped mid-step (`abandon`)

    def wait_started(self) -> None:
        """Until every worker said it started and subscribed to the steps (then any step reaches it)."""
        self.monitor.wait_for(lambda: len(self.monitor.started) == len(self.processes), "start", self.timeout)
        for rank, pid in sorted(self.monitor.started.items()):
            logger.info("tensor-parallel rank %d started (pid %d)", rank, pid)
        subscribed = 0
        deadline = time.monotonic() + self.timeout
        while subscribed < len(self.processes):
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers: not subscribed within {self.timeout:.0f}s")
            if self.steps.poll(100) and self.steps.recv()[:1] == b"\x01":
                subscribed += 1
        # Every worker is connected to both sockets (its start came through the results one), so their files
        # have done their work: removed now, they cannot outlive a driver killed before `shutdown` (the
        # frontend SIGKILLs a core that reported a failure).
        shutil.rmtree(self._directory, ignore_errors=True)

    def wait_ready(self) -> None:
        """Until every worker loaded its part of the model and allocated its KV cache."""
        self.monitor.wait_for(lambda: len(self.monitor.ready) == len(self.processes), "ready", self.timeout)

    def broadcast(self, message: bytes) -> None:
        """One step to every worker (sent once)."""
        self.steps.send(message)

    def check(self) -> None:
        """Raises the first worker failure's `WorkerDiedError` (or the one `abandon` gave)."""
        if self.abandoned is not None:
            raise WorkerDiedError(f"tensor-parallel ranks 1..{self.world_size - 1} {self.abandoned}")
        if self.monitor.failure is not None:
            raise self.monitor.failure.error()

    def abandon(self, reason: str) -> None:
        """Kills the workers at once (rank 0 left a step they are still in: they can never pair their
        collectives with its again) and shuts down; `check` raises `WorkerDiedError` with `reason` from
        now on."""
        self.abandoned = reason
        self.shutdown(at_once=True)

    def shutdown(self, at_once: bool = False) -> None:
        """Stops the workers (killed after STOP_SECONDS; `at_once`: killed now), the monitor, and removes
        the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(zmq.ZMQError):
            self.steps.send(encode(StopWorkers()), zmq.NOBLOCK)
        self.monitor.stop()  # workers exiting from now on are not failures to report
        deadline = time.monotonic() + (0.0 if at_once else STOP_SECONDS)
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self.steps.close(linger=0)
        self.monitor.results.close(linger=0)
        self._context.term()
        shutil.rmtree(self._directory, ignore_errors=True)
