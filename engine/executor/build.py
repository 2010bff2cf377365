"""The engine core's model runner: one `ModelRunner`, or a `MultiprocExecutor` over tensor-parallel ranks."""

from __future__ import annotations

from sluice.engine.config import EngineConfig
from sluice.engine.executor.multiproc_executor import MultiprocExecutor
from sluice.engine.loading.model_loader import ModelSource
from sluice.engine.worker.model_runner import ModelRunner


def build_model_runner(config: EngineConfig, source: ModelSource) -> ModelRunner | MultiprocExecutor:
    """`config.parallel.tensor_parallel_size` 1: the model in this process; N > 1: rank 0 here, ranks
    1..N-1 in worker processes (`sluice.engine.executor.multiproc_executor`). Raises ValueError naming
    `tensor_parallel_size` when the model or the machine cannot be split so."""
    if config.parallel.tensor_parallel_size == 1:
        return ModelRunner(config, source)
    return MultiprocExecutor(config, source)
