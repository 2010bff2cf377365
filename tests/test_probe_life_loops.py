"""An AsyncEngine belongs to the event loop that started it: only that loop's tasks read the core's results.

A script that started it in one `asyncio.run` and sent a request from the next waited forever (the first
loop's reader was cancelled when it closed); a second `start` spawned a second core behind the same sockets
and waited forever for its CoreReady. Both are refused now, saying why, and a `shutdown` from a later loop
still stops the core."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from service_harness import PATIENCE_S

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _engine(model_dir: str) -> AsyncEngine:
    config = EngineConfig(
        model=ModelConfig(model=model_dir), cache=CacheConfig(block_size=16), attention_backend="torch"
    )
    return AsyncEngine(config, engine_timeout=3600.0)


async def _generate(engine: AsyncEngine, request_id: str) -> list[int]:
    stream = await engine.add_request(request_id, PARAMS, text="hello world")
    return [t async for output in stream for t in output.token_ids]


def test_a_request_from_a_later_asyncio_run_is_refused_and_its_shutdown_stops_the_core(llama_dir):
    engine = _engine(llama_dir)
    asyncio.run(engine.start())
    process, directory = engine._client.process, engine._client._directory
    try:
        with pytest.raises(RuntimeError, match="the event loop that started this engine has closed"):
            asyncio.run(asyncio.wait_for(_generate(engine, "late"), PATIENCE_S))
    finally:
        asyncio.run(asyncio.wait_for(engine.shutdown(), PATIENCE_S))
    assert process.join(PATIENCE_S) == 0  # told to stop, not killed
    assert not os.path.exists(directory)
    asyncio.run(engine.shutdown())  # twice: nothing left to do


def test_a_request_from_another_running_loop_is_refused(llama_dir):
    engine = _engine(llama_dir)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(engine.start(), loop).result(PATIENCE_S)
        with pytest.raises(RuntimeError, match="this engine was started on another event loop"):
            asyncio.run(asyncio.wait_for(_generate(engine, "elsewhere"), PATIENCE_S))
        with pytest.raises(RuntimeError, match="this engine was started on another event loop"):
            asyncio.run(engine.shutdown())
        # Its own loop serves on.
        generated = asyncio.run_coroutine_threadsafe(_generate(engine, "home"), loop).result(PATIENCE_S)
        assert len(generated) == PARAMS.max_tokens
    finally:
        asyncio.run_coroutine_threadsafe(engine.shutdown(), loop).result(PATIENCE_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(PATIENCE_S)
        loop.close()


async def test_a_second_start_is_refused_and_leaves_the_first_core_serving(llama_dir):
    engine = _engine(llama_dir)
    await engine.start()
    try:
        core_pid = engine.core_pid
        with pytest.raises(RuntimeError, match="the engine core was started before"):
            await asyncio.wait_for(engine.start(), PATIENCE_S)
        assert engine.core_pid == core_pid
        assert len(await asyncio.wait_for(_generate(engine, "after"), PATIENCE_S)) == PARAMS.max_tokens
    finally:
        await engine.shutdown()
    with pytest.raises(RuntimeError, match="the engine core was started before"):
        await engine.start()  # nor after its shutdown
