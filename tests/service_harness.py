"""A real Sluice gRPC server on a loopback port, run on its own uvloop event loop in a background thread.

Tests talk to it through the generated stubs or the `sluice` client from the test's own thread (or
its own event loop), exactly as a remote client would.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc
import uvloop
from checkpoints import LONG_CONTEXT
from prometheus_client.parser import text_string_to_metric_families

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.engine.outputs import EngineStats
from sluice.service.server import ServerConfig, SluiceServer
from sluice.v1 import sluice_pb2_grpc as pb_grpc

T = TypeVar("T")
# /metrics samples: (name, sorted (label, value) pairs) -> value
MetricSamples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# A request that runs until the test ends it (cancel, Abort, a deadline, a drain), on a server of the
# long-context tiny Llama (`llama_long_dir`, `long_engine_config`): 131,000 tokens are minutes of decoding on
# any machine, so a test may rely on it still running, however fast the machine. (No request on the
# 256-token `llama_dir` can be relied on to outlast anything: a fast machine decodes 240 tokens in 0.1 s.)
UNENDING_TOKENS = LONG_CONTEXT - 72  # room for the prompts the tests send
UNENDING = {"temperature": 0.0, "max_tokens": UNENDING_TOKENS, "ignore_eos": True}
# KV blocks for every request to fit (the engine refuses one that could never fit), plus room for others.
LONG_NUM_BLOCKS = LONG_CONTEXT // 16 + 128
# How long a test waits for something that must happen: only a hang takes this long.
PATIENCE_S = 60.0


async def drain(call: grpc.aio.UnaryStreamCall, chunks: list[Any] | None = None) -> grpc.StatusCode:
    """Reads a grpc.aio streaming call to its end (its messages into `chunks`, when given); returns its
    status code, CANCELLED for a call this client cancelled."""
    try:
        async for chunk in call:
            if chunks is not None:
                chunks.append(chunk)
    except grpc.aio.AioRpcError as error:
        return error.code()
    except asyncio.CancelledError:  # grpc.aio: reading a call this client cancelled
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK


def status_code(value: int) -> grpc.StatusCode:
    """The StatusCode of an in-band RequestError's numeric `code`."""
    return next(code for code in grpc.StatusCode if code.value[0] == value)


def bench_load(target: str, workload, config, transport=None):
    """`sluice bench`'s `run_load` of `workload` against the server at `target`, through a transport
    (GenerateTransport unless given) on a client of its own, closed after: the RunResult."""
    from sluice.bench.runner import run_load
    from sluice.bench.transports import GenerateTransport
    from sluice.client import AsyncClient

    async def run():
        bench = (transport or GenerateTransport)(AsyncClient(target))
        try:
            return await run_load(bench, workload, config)
        finally:
            await bench.close()

    return asyncio.run(run())


def wait_for(condition: Callable[[], bool], what: str, timeout: float = PATIENCE_S) -> None:
    """Polls `condition` until it holds; fails naming `what` after `timeout` (a hang, not a slow machine)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f} s"
        time.sleep(0.01)


def long_engine_config(model_dir: str, *, max_num_seqs: int = 64) -> EngineConfig:
    """`tiny_engine_config` for the long-context tiny Llama, with KV blocks for UNENDING requests."""
    return tiny_engine_config(model_dir, num_blocks=LONG_NUM_BLOCKS, max_num_seqs=max_num_seqs)


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
        kv_events: bool = False,
    ) -> None:
        self._engine_config = engine_config
        self._max_queue = max_queue
        self._kv_events = kv_events
        config = server_config or ServerConfig(host="127.0.0.1", port=0)
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sluice-test-server", daemon=True)
        self._thread.start()
        self.server = self.call(self._make_server(config, tracer_provider))
        self.engine: AsyncEngine | None = None

    async def _make_server(self, config: ServerConfig, tracer_provider: Any) -> SluiceServer:
        return SluiceServer(config, tracer_provider=tracer_provider)

    def start(self, *, attach: bool = True) -> ServerThread:
        """Starts the server (and the engine); if that fails, stops what did start before raising, so a
        failed start leaves no server, engine core or loop behind for later tests."""
        try:
            self.call(self.server.start())
            if attach:
                self.attach()
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        return self

    def attach(self) -> None:
        self.engine = AsyncEngine(self._engine_config, self._max_queue, kv_events=self._kv_events)
        self.call(self.engine.start())
        self.call(self.server.attach_engine(self.engine))

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = PATIENCE_S) -> T:
        """Runs a coroutine on the server's loop and returns its result; one that takes past `timeout` (a
        hang) is cancelled, so that nothing it started (an engine core loading) outlives the test."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def stats(self) -> EngineStats:
        assert self.engine is not None
        return self.engine.stats()

    def metric_samples(self) -> MetricSamples:
        """The server's /metrics now (it needs a metrics port), by sample name and sorted labels."""
        url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def wait_idle(self, timeout: float = PATIENCE_S) -> EngineStats:
        """Waits until no request runs or waits and no KV block is held; returns the stats then. (With an
        UNENDING request ended by the test, the timeout can only pass if the end never reached the engine.)"""

        def idle() -> bool:
            stats = self.stats()
            done = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_kv_blocks_used == 0
            return done and self.engine.num_live_requests == 0

        wait_for(idle, f"engine idle ({self.stats()})", timeout)
        return self.stats()

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
