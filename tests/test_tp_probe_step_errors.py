"""An exception in rank 0's part of a tensor-parallel step, as a probe found it: only a KeyboardInterrupt
stopped the workers left inside the step. An ordinary exception on rank 0 alone (out of memory: rank 0
also holds a draft model and the sampler's state) left them there, so the offline `LLM`'s next generate
paired its collectives with the old step's and gloo aborted the whole process (`terminate called after
throwing an instance of 'gloo::EnforceNotMet'`, SIGABRT), or hung for the distributed timeout where the
sizes happened to match. Now any exception there stops the workers at once and the next call raises
`WorkerDiedError` saying why; a worker's own failure keeps its own message."""

from __future__ import annotations

from unittest import mock

import pytest

from sluice.engine.executor.worker_monitor import WorkerDiedError
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)


def test_an_exception_on_rank_zero_alone_stops_the_workers_and_the_next_call_says_why(llama_dir):
    llm = LLM(llama_dir, tensor_parallel_size=2, num_blocks=16, distributed_timeout_seconds=3600)
    executor = llm.engine.model_runner
    try:
        workers = list(executor.workers.processes.values())
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        oom = RuntimeError("out of memory on rank 0")
        with (
            mock.patch.object(executor.runner, "execute_model_with_prompt_logprobs", side_effect=oom),
            pytest.raises(RuntimeError, match="^out of memory on rank 0$"),
        ):
            llm.generate([[5, 6, 7, 8]], params)
        assert not any(worker.is_alive() for worker in workers)
        assert executor.failed
        with pytest.raises(
            WorkerDiedError,
            match=r"^tensor-parallel ranks 1\.\.1 were stopped: RuntimeError interrupted a step on rank 0 "
            r"\(out of memory on rank 0\), leaving the others inside it",
        ):
            llm.generate([[5, 6, 7, 8]], params)
    finally:
        executor.shutdown()
