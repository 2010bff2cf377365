"""What crosses between the driver (rank 0, in the engine core's process) and the workers (ranks 1..N-1).

    driver                                        worker (rank r)
    ------                                        ---------------
    steps (ZeroMQ XPUB, one message per step,     SUB: ExecuteModel -> its runner runs the same step;
           sent once, fanned out by ZeroMQ)            StopWorkers -> exits 0
    the step before's sampled tokens (async       the group's broadcast, from rank 0's device to
           scheduling: ExecuteModel.tokens_before)     each rank's, as the step starts
    results (PULL)                          <--   PUSH: WorkerStarted (before the rendezvous),
                                                        WorkerReady (model loaded, cache allocated),
                                                        WorkerFailed (then it exits 1)
    WorkerSpec: spawn argument (msgspec bytes)

msgspec structs over msgpack (the scheduler output is plain data already): no pickle of a step.
"""

from __future__ import annotations

import msgspec

from sluice.engine.config import EngineConfig
from sluice.engine.scheduler.scheduler_output import PromptLogprobsSlice, SchedulerOutput


class WorkerSpec(msgspec.Struct, frozen=True):
    """Everything a worker process needs to start: its rank, where to meet the others, what to load."""

    rank: int
    world_size: int
    config: EngineConfig
    device: str  # "cpu", or "cuda:<rank>"
    num_threads: int  # torch intra-op threads (cpu)
    rendezvous_host: str
    rendezvous_port: int
    steps_address: str
    results_address: str


class TokensBefore(msgspec.Struct, frozen=True):
    """Async scheduling: the step before's sampled tokens fill this step's placeholders. Rank 0 holds them
    on its device and broadcasts them over the group as the step starts (`ModelRunner`); the message says
    how many (int64) and which request's is which (`SampledTokenIds.rows`)."""

    rows: dict[str, int]
    num_sampled: int


class ExecuteModel(msgspec.Struct, tag=True):
    """Run `ModelRunner.execute_model_with_prompt_logprobs(scheduler_output, prompt_logprobs,
    sampled_before)`, `sampled_before` received from rank 0 when `tokens_before` is set."""

    scheduler_output: SchedulerOutput
    prompt_logprobs: tuple[PromptLogprobsSlice, ...] = ()
    tokens_before: TokensBefore | None = None


class StopWorkers(msgspec.Struct, tag=True):
    pass


class WorkerStarted(msgspec.Struct, tag=True):
    rank: int
    pid: int


class WorkerReady(msgspec.Struct, tag=True):
    rank: int
    parameter_bytes: int  # the rank's part of the weights, as laid out
    num_blocks: int


class WorkerFailed(msgspec.Struct, tag=True):
    rank: int
    error: str


DriverMessage = ExecuteModel | StopWorkers
WorkerMessage = WorkerStarted | WorkerReady | WorkerFailed

encode = msgspec.msgpack.Encoder().encode
decode_driver_message = msgspec.msgpack.Decoder(DriverMessage).decode
decode_worker_message = msgspec.msgpack.Decoder(WorkerMessage).decode
decode_worker_spec = msgspec.msgpack.Decoder(WorkerSpec).decode
