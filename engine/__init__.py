"""Sluice engine: paged KV cache, continuous batching, chunked prefill, prefix caching."""

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "EngineStats",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
