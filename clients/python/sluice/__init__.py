"""Sluice: a gRPC-native LLM inference engine, and its Python client.

    from sluice import LLM, SamplingParams              # the engine in this process (offline)
    from sluice import Client, AsyncClient              # a Sluice server over gRPC

Names resolve on first use, so `import sluice` (and the client alone) never imports torch: a gRPC client
or the server's frontend process pays only for what it touches.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# public name -> module that defines it
_EXPORTS = {
    "LLM": "sluice.engine.frontend.llm",
    "AsyncEngine": "sluice.engine.frontend.async_engine",
    "SamplingParams": "sluice.engine.sampling_params",
    "Constraint": "sluice.engine.structured.constraint",
    "Tool": "sluice.engine.structured.tool_calls",
    "ToolUse": "sluice.engine.structured.tool_calls",
    "EngineConfig": "sluice.engine.config",
    "ModelConfig": "sluice.engine.config",
    "CacheConfig": "sluice.engine.config",
    "SchedulerConfig": "sluice.engine.config",
    "ParallelConfig": "sluice.engine.config",
    "SpeculativeConfig": "sluice.engine.config",
    "RequestOutput": "sluice.engine.outputs",
    "EngineStats": "sluice.engine.outputs",
    "Client": "sluice.client",
    "AsyncClient": "sluice.client",
    "Completion": "sluice.completion",
    "SluiceError": "sluice.sluice_error",
    "generate_request": "sluice.request_builders",
    "SERVICE_CONFIG": "sluice.service_config",
}

__all__ = [
    "AsyncClient",
    "AsyncEngine",
    "CacheConfig",
    "Client",
    "Completion",
    "Constraint",
    "EngineConfig",
    "EngineStats",
    "LLM",
    "ModelConfig",
    "ParallelConfig",
    "RequestOutput",
    "SERVICE_CONFIG",
    "SamplingParams",
    "SchedulerConfig",
    "SluiceError",
    "SpeculativeConfig",
    "Tool",
    "ToolUse",
    "generate_request",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sluice' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from sluice.client import AsyncClient, Client
    from sluice.completion import Completion
    from sluice.engine.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )
    from sluice.engine.frontend.async_engine import AsyncEngine
    from sluice.engine.frontend.llm import LLM
    from sluice.engine.outputs import EngineStats, RequestOutput
    from sluice.engine.sampling_params import SamplingParams
    from sluice.engine.structured.constraint import Constraint
    from sluice.engine.structured.tool_calls import Tool, ToolUse
    from sluice.request_builders import generate_request
    from sluice.service_config import SERVICE_CONFIG
    from sluice.sluice_error import SluiceError
