"""A tensor-parallel worker process: rank r of N (r >= 1), spawned by `MultiprocExecutor`.

    connect: SUB to the driver's steps, PUSH to its results; send WorkerStarted
    join the group (gloo / NCCL on the rendezvous store), load this rank's part of the model, allocate its
        KV cache (the ranks agree on the block count), send WorkerReady
    loop: each ExecuteModel runs the same step as rank 0 (the layers' collectives pair up); StopWorkers
        exits 0; the driver's process gone exits 0 (while loading too: `ParentWatch`)
    anything raised: WorkerFailed(error) to the driver, exit 1 (the driver fails the engine)

Its logits are dropped: rank 0 samples. The worker never talks to the frontend.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys

import torch
import zmq

from sluice.engine.distributed.group import TensorParallelGroup
from sluice.engine.distributed.rendezvous import Rendezvous
from sluice.engine.executor.messages import (
    ExecuteModel,
    StopWorkers,
    WorkerFailed,
    WorkerReady,
    WorkerSpec,
    WorkerStarted,
    decode_driver_message,
    decode_worker_spec,
    encode,
)
from sluice.engine.faults import FaultInjector
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.parent_watch import ParentWatch
from sluice.engine.worker.input_batch import SampledTokenIds
from sluice.engine.worker.model_runner import ModelRunner

logger = logging.getLogger("sluice.tp_worker")


def run_worker(spec_bytes: bytes) -> None:
    """The process's target: `spec_bytes` is an encoded `WorkerSpec`. Exits with the loop's code.

    SIGINT is ignored, as the server's engine core ignores it: rank 0 owns the workers' lifetime. A Ctrl-C
    at the prompt of an offline `LLM`'s REPL reaches its whole process group and killed them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = decode_worker_spec(spec_bytes)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[rank {spec.rank}]: %(message)s"
    )
    sys.exit(WorkerProcess(spec).run())


class WorkerProcess:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.context = zmq.Context()
        self.steps = self.context.socket(zmq.SUB)
        self.steps.setsockopt(zmq.SUBSCRIBE, b"")
        self.steps.connect(spec.steps_address)
        self.results = self.context.socket(zmq.PUSH)
        self.results.connect(spec.results_address)
        self.faults = FaultInjector.from_env()

    def run(self) -> int:
        spec = self.spec
        self.results.send(encode(WorkerStarted(spec.rank, os.getpid())))
        driver = multiprocessing.parent_process()
        assert driver is not None and driver.pid is not None, "a worker is a process the driver spawned"
        try:
            with ParentWatch(driver.pid, lambda: None, f"rank {spec.rank} loaded the model"):
                runner = self._load()
            self.results.send(encode(WorkerReady(spec.rank, runner.parameter_bytes, runner.num_blocks)))
            return self._loop(runner)
        except Exception as exc:
            logger.exception("tensor-parallel worker failed")
            self.results.send(encode(WorkerFailed(spec.rank, f"{type(exc).__name__}: {exc}")))
            return 1
        finally:
            self.results.close(linger=1000)  # the last message (WorkerFailed) must reach the driver
            self.steps.close(linger=0)
            self.context.term()

    def _load(self) -> ModelRunner:
        spec = self.spec
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(spec.num_threads)
        torch.set_num_interop_threads(1)
        timeout = spec.config.parallel.distributed_timeout_seconds
        store = Rendezvous(spec.rendezvous_host, spec.rendezvous_port, timeout).join(spec.world_size)
        if self.faults is not None:
            self.faults.check("join", [str(spec.rank)])
        group = TensorParallelGroup.join(store, spec.rank, spec.world_size, device, timeout)
        runner = ModelRunner(spec.config, load_model_source(spec.config.model), group)
        logger.info(
            "rank %d ready: %.1f MiB of parameters, %d KV blocks",
            spec.rank,
            runner.parameter_bytes / 2**20,
            runner.num_blocks,
        )
        return runner

    def _loop(self, runner: ModelRunner) -> int:
        """Runs each broadcast step until told to stop or the driver's process is gone."""
        parent = multiprocessing.parent_process()
        poller = zmq.Poller()
        poller.register(self.steps, zmq.POLLIN)
        if parent is not None:
            poller.register(parent.sentinel, zmq.POLLIN)  # readable once the driver's process is gone
        while True:
            events = dict(poller.poll())
            if self.steps not in events:
                logger.info("the driver's process is gone; exiting")
                return 0
            message = decode_driver_message(self.steps.recv())
            if isinstance(message, StopWorkers):
                return 0
            assert isinstance(message, ExecuteModel)
            out = message.scheduler_output
            if self.faults is not None:
                self.faults.check("worker", (s.request_id for s in out.scheduled))
            runner.execute_model_with_prompt_logprobs(
                out, message.prompt_logprobs, _room_for(message, runner)
            )


def _room_for(message: ExecuteModel, runner: ModelRunner) -> SampledTokenIds | None:
    """Where this rank receives rank 0's tokens of the step before (async scheduling: the driver sent
    `tokens_before` with the step), int64 as rank 0 sampled them; the runner's broadcast fills it."""
    before = message.tokens_before
    if before is None:
        return None
    return SampledTokenIds(
        torch.empty(before.num_sampled, dtype=torch.int64, device=runner.device), before.rows
    )
