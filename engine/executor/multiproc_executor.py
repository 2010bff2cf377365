"""Tensor parallelism over N processes: the engine core's process is rank 0 (nano-vllm's layout), ranks 1..N-1
are worker processes it spawns (`worker.py`). To `EngineCore` it is a `ModelRunner`: the same members, the
same logits.

    EngineCore.step()
      scheduler.schedule() -> SchedulerOutput
      executor.execute_model(out):
          broadcast ExecuteModel(out) once (ZeroMQ XPUB)  ->  every worker: runner.execute_model(out)
          rank 0: runner.execute_model(out)                    (layers' all-reduces pair the ranks up)
              async scheduling: rank 0's sampled tokens of the step before, on its device, go to every
              rank's device by the group's broadcast as the step starts (`ExecuteModel.tokens_before`)
          <- logits [num_sampled, vocab]: rank 0's, gathered over the vocabulary (every rank has them)
      sampler (rank 0 only), scheduler update

Why rank 0 is the driver itself and not one more process (vLLM's `MultiprocExecutor`): sampling stays where
it is, in the core, with the logits it needs already in its process. Sampling state (per-request generators,
penalties, grammar matchers, the speculator's drafts) never moves to a worker, no logits cross processes (a
[batch, vocab] float32 tensor per step), there is no result message to wait for, and N devices take N
processes, not N + 1. The price: the scheduler's host work and rank 0's launches are serialized, as they are
with one rank; and the offline `LLM`'s caller process is rank 0.

Logits: gathered (all-gather of the vocabulary shards) rather than sampled in a distributed way, so the
sampler and the speculative rejection sampler run unchanged. Every rank gets them so every rank runs the
same code (prompt logprobs included); only rank 0 samples.

Failure: a worker that exits or raises is noticed by the `WorkerMonitor` (process sentinels, no polling
timer); the next call raises `WorkerDiedError`, as does a collective that fails because of it (gloo raises
at once when a peer's connection drops; a silent peer fails it after `distributed_timeout_seconds`). In a
server that ends the engine core with `CoreFailed`, like any failed step. An exception in rank 0's own part
of a step (out of memory, a KeyboardInterrupt) kills the workers at once: they are still inside the step,
and their collectives would pair with the next step's.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch.distributed import Store

from sluice.engine.config import EngineConfig
from sluice.engine.distributed.group import TensorParallelGroup
from sluice.engine.distributed.rendezvous import Rendezvous
from sluice.engine.executor.messages import ExecuteModel, TokensBefore, encode
from sluice.engine.executor.placement import place_ranks
from sluice.engine.executor.worker_monitor import WorkerDiedError
from sluice.engine.executor.worker_processes import WorkerProcesses
from sluice.engine.loading.model_loader import ModelSource
from sluice.engine.outputs import PromptLogprobs
from sluice.engine.scheduler.scheduler_output import PromptLogprobsSlice, SchedulerOutput
from sluice.engine.worker.input_batch import SampledTokenIds
from sluice.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
T = TypeVar("T")

# After a collective failed: how long the monitor may take to name the worker that caused it.
FAILURE_NAMING_SECONDS = 2.0


class MultiprocExecutor:
    """Rank 0's `ModelRunner` (`runner`) plus the workers. `execute_model*`, `config`, `num_blocks`,
    `max_model_len` as `ModelRunner`'s; `check_health()` raises `WorkerDiedError` once a worker is gone.
    `shutdown()` (also run when the executor is collected, or at exit) stops the workers."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        placement = place_ranks(config, source.arch)
        size, timeout = config.parallel.tensor_parallel_size, config.parallel.distributed_timeout_seconds
        rendezvous, store = Rendezvous.from_env(timeout).serve(size)
        threads = (torch.get_num_threads(), placement.num_threads)  # before, and rank 0's while it runs
        self.workers = WorkerProcesses(config, placement, rendezvous)
        self._finalizer = weakref.finalize(self, _shutdown, self.workers, *threads)
        try:
            device = placement.devices[0]
            if device.type == "cuda":
                torch.cuda.set_device(device)
            else:
                torch.set_num_threads(placement.num_threads)
            self.workers.wait_started()
            group = self._join_watched(store, size, device, timeout)
            # A ValueError is a setting refused naming its field, which every rank refuses alike.
            self.runner = self._named_failures(ModelRunner, config, source, group, keep=(ValueError,))
            self.workers.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._store = store  # rank 0 serves the rendezvous for the group's lifetime
        ready = self.workers.monitor.ready
        # Each rank's parameter bytes (rank 0 first), as it measured them after loading.
        self.parameter_bytes = [self.runner.parameter_bytes] + [
            ready[r].parameter_bytes for r in sorted(ready)
        ]
        logger.info(
            "tensor parallel: %d ranks on %s, %d threads each; parameters per rank (MiB): %s",
            size,
            device,
            placement.num_threads,
            ", ".join(f"{b / 2**20:.1f}" for b in self.parameter_bytes),
        )

    @property
    def config(self) -> EngineConfig:
        return self.runner.config

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def failed(self) -> bool:
        """A worker is gone (or was stopped): the next call raises."""
        return self.workers.monitor.failure is not None or self.workers.abandoned is not None

    def check_health(self) -> None:
        self.workers.check()

    def execute_model(
        self, out: SchedulerOutput, sampled_before: SampledTokenIds | None = None
    ) -> torch.Tensor:
        return self.execute_model_with_prompt_logprobs(out, (), sampled_before)[0]

    def execute_model_with_prompt_logprobs(
        self,
        out: SchedulerOutput,
        slices: Sequence[PromptLogprobsSlice],
        sampled_before: SampledTokenIds | None = None,
    ) -> tuple[torch.Tensor, dict[str, PromptLogprobs]]:
        """`ModelRunner.execute_model_with_prompt_logprobs` on every rank; rank 0's result. With
        `sampled_before` (async scheduling: rank 0's tokens of the step before, still on its device) every
        rank's runner receives those tokens from rank 0 as the step starts and fills its placeholders."""
        self.workers.check()
        assert sampled_before is None or sampled_before.token_ids.dtype == torch.int64  # as workers receive
        before = (
            None
            if sampled_before is None
            else TokensBefore(dict(sampled_before.rows), len(sampled_before.token_ids))
        )
        self.workers.broadcast(encode(ExecuteModel(out, tuple(slices), before)))
        try:
            return self._named_failures(
                self.runner.execute_model_with_prompt_logprobs, out, slices, sampled_before
            )
        except BaseException as exc:  # rank 0 left a step its workers may still be in
            self._stop_workers_left_in_step(exc)
            raise

    def _stop_workers_left_in_step(self, exc: BaseException) -> None:
        """Rank 0's part of a step raised (an exception of its own, out of memory, a KeyboardInterrupt, or
        a collective a failing worker broke): the workers still in that step would pair their collectives
        with the next step's, which gloo answers by aborting the whole process. They are killed at once;
        unless a worker's own failure explains it, the next call raises `WorkerDiedError` saying why."""
        if self.workers.monitor.failure is not None:
            self.workers.shutdown(at_once=True)
            return
        detail = f" ({exc})" if str(exc) else ""
        self.workers.abandon(
            f"were stopped: {type(exc).__name__} interrupted a step on rank 0{detail}, leaving the others "
            "inside it (their collectives would pair with the wrong ones); build a new engine"
        )

    def shutdown(self) -> None:
        """Stops the workers; rank 0's torch threads go back to what they were."""
        self._finalizer()

    def _join_watched(
        self, store: Store, size: int, device: torch.device, timeout: float
    ) -> TensorParallelGroup:
        """Rank 0's join of the group, in a thread while this one watches the workers: a worker that dies
        before it joins fails the start at once with its WorkerDiedError (the join alone waited for the
        store's `timeout`, 300 s by default, then named no rank)."""
        joined: list[TensorParallelGroup | BaseException] = []

        def join() -> None:
            try:
                joined.append(TensorParallelGroup.join(store, 0, size, device, timeout))
            except BaseException as exc:
                joined.append(exc)
            self.workers.monitor.notify()

        threading.Thread(target=join, name="sluice-tp-join", daemon=True).start()
        self.workers.monitor.wait_for(lambda: bool(joined), "group join", timeout + FAILURE_NAMING_SECONDS)
        if isinstance(joined[0], BaseException):
            raise joined[0]
        return joined[0]

    def _named_failures(
        self, call: Callable[..., T], *args: object, keep: tuple[type[Exception], ...] = ()
    ) -> T:
        """call(*args); an exception raised while a worker is failing becomes that worker's
        `WorkerDiedError` (the collective that broke names no rank), unless it is one of `keep`."""
        try:
            return call(*args)
        except keep:
            raise
        except Exception as exc:
            try:
                self.workers.monitor.wait_for(lambda: False, "failure", FAILURE_NAMING_SECONDS)
            except WorkerDiedError as died:
                raise died from exc
            except TimeoutError:
                pass
            raise


def _shutdown(workers: WorkerProcesses, threads_before: int, threads_set: int) -> None:
    workers.shutdown()
    if torch.get_num_threads() == threads_set:  # else another engine set them since: its to keep
        torch.set_num_threads(threads_before)
