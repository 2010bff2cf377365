"""A real Sluice gRPC server on a loopback port, run on its own uvloop event loop in a background thread.

Tests talk to it through the generated stubs or the `sluice` client from the test's own thread (or
its own event loop), exactly as a remote client would.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import uvloop

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.engine.outputs import EngineStats
from sluice.service.server import ServerConfig, SluiceServer
from sluice.v1 import sluice_pb2_grpc as pb_grpc

T = TypeVar("T")

# A request that keeps the tiny model busy: 6 prompt tokens + 240 fit its 256-token context, and decoding
# them takes about 0.3 s on a quiet machine (timeouts meant to fire mid-generation stay below that).
LONG = {"temperature": 0.0, "max_tokens": 240, "ignore_eos": True}


def tiny_engine_config(model_dir: str, *, num_blocks: int = 128, max_num_seqs: int = 64) -> EngineConfig:
    """The torch attention backend keeps CPU tests fast (the Triton kernels have their own tests)."""
    return EngineConfig(
        model=ModelConfig(model=model_dir),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max_num_seqs),
        attention_backend="torch",
    )


class ServerThread:
    """Starts SluiceServer + AsyncEngine on a private loop; `stop()` tears both down."""

    def __init__(
        self,
        engine_config: EngineConfig,
        server_config: ServerConfig | None = None,
        *,
        max_queue: int | None = None,
        tracer_provider: Any = None,
    ) -> None:
        self._engine_config = engine_config
        self._max_queue = max_queue
        config = server_config or ServerConfig(host="127.0.0.1", port=0)
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sluice-test-server", daemon=True)
        self._thread.start()
        self.server = self.call(self._make_server(config, tracer_provider))
        self.engine: AsyncEngine | None = None

    async def _make_server(self, config: ServerConfig, tracer_provider: Any) -> SluiceServer:
        return SluiceServer(config, tracer_provider=tracer_provider)

    def start(self, *, attach: bool = True) -> ServerThread:
        self.call(self.server.start())
        if attach:
            self.attach()
        return self

    def attach(self) -> None:
        self.engine = AsyncEngine(self._engine_config, self._max_queue)
        self.call(self.engine.start())
        self.call(self.server.attach_engine(self.engine))

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stats(self) -> EngineStats:
        assert self.engine is not None
        return self.engine.stats()

    def wait_idle(self, timeout: float = 5.0) -> EngineStats:
        """Waits until no request runs or waits and no KV block is held; returns the stats then."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_kv_blocks_used == 0
            if idle and self.engine.num_live_requests == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {stats}")
            time.sleep(0.01)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def stub(self, channel: grpc.Channel) -> pb_grpc.InferenceServiceStub:
        return pb_grpc.InferenceServiceStub(channel)

    def stop(self) -> None:
        self.call(self.server.stop(0))
        if self.engine is not None:
            self.call(self.engine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
