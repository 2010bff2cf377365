"""Sluice engine: paged KV cache, continuous batching, chunked prefill, prefix caching."""

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sluice.engine.outputs import EngineStats, RequestOutput
from sluice.engine.sampling_params import SamplingParams

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "EngineStats",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
