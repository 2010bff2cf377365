"""AsyncEngine: streaming from the engine thread, aborts, abandoned streams, and request validation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.errors import ContextLengthError, EngineDeadError, InvalidRequestError, QueueFullError
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
async def engine(llama_dir):
    engine = AsyncEngine(EngineConfig(model=ModelConfig(model=llama_dir), cache=CacheConfig(block_size=16)))
    await engine.start()
    yield engine
    await engine.shutdown()


async def _collect(stream):
    outputs = [out async for out in stream]
    return outputs


async def _wait_for_free_blocks(engine: AsyncEngine) -> None:
    for _ in range(200):
        if engine.stats().num_kv_blocks_used == 0 and engine.stats().num_running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks still held: {engine.stats()}")


async def test_concurrent_streams_equal_the_offline_engine(engine, llama_dir):
    prompts = ["the quick brown fox", "Hello world! How are you today?", "Numbers: 1 2 3"]
    offline = LLM(llama_dir).generate(prompts, PARAMS)
    streams = [engine.add_request(f"req-{i}", PARAMS, text=p) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(_collect(s) for s in streams))
    for outputs, expected in zip(results, offline, strict=True):
        assert [t for o in outputs for t in o.token_ids] == expected.token_ids
        assert "".join(o.text for o in outputs) == expected.text
        assert outputs[-1].finish_reason == "length"
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        usage = outputs[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_token_ids), 8)
        timings = outputs[-1].timings
        assert timings.arrival <= timings.first_scheduled <= timings.first_token <= timings.finished
    await _wait_for_free_blocks(engine)


async def test_abort_ends_the_stream_and_frees_blocks(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = engine.add_request("long", params, text="the quick brown fox")
    first = await anext(stream)
    assert first.token_ids
    assert engine.stats().num_kv_blocks_used > 0
    await engine.abort("long")
    rest = [out async for out in stream]
    assert rest[-1].finish_reason == "abort"
    assert sum(len(o.token_ids) for o in rest) < 199
    await _wait_for_free_blocks(engine)
    assert not engine.has_request("long")


async def test_cancelling_the_consumer_aborts_the_request(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = engine.add_request("abandoned", params, text="the quick brown fox")

    async def consume():
        async for _ in stream:
            pass

    task = asyncio.create_task(consume())
    while engine.stats().num_running == 0:
        await asyncio.sleep(0.005)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await _wait_for_free_blocks(engine)
    assert engine.num_live_requests == 0


async def test_bad_requests_raise_before_queueing(engine):
    cases = [
        (dict(text=""), InvalidRequestError, "prompt: is empty: give text, token_ids or messages"),
        (
            dict(token_ids=[1, 99999]),
            InvalidRequestError,
            "token_ids: token id 99999 is outside the vocabulary",
        ),
        (
            dict(text="a", token_ids=[1]),
            InvalidRequestError,
            "prompt: give exactly one of text, token_ids, messages",
        ),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message.replace("(", r"\(").replace("[", r"\[")):
            engine.add_request("bad", PARAMS, **kwargs)
    too_long = SamplingParams(max_tokens=250)
    with pytest.raises(ContextLengthError, match=r"max_tokens: prompt \(\d+ tokens\) \+ max_tokens \(250\)"):
        engine.add_request("long", too_long, text="the quick brown fox jumps over the lazy dog")
    stream = engine.add_request("dup", PARAMS, text="hi")
    with pytest.raises(InvalidRequestError, match="request_id: 'dup' is already in use"):
        engine.add_request("dup", PARAMS, text="hi")
    await _collect(stream)
    assert engine.num_live_requests == 0


async def test_queue_bound_rejects_with_queue_full(llama_dir):
    config = EngineConfig(model=ModelConfig(model=llama_dir))
    engine = AsyncEngine(config, max_queue=2)
    # Not started: nothing leaves the queue, so the third request finds it full.
    held = [engine.add_request("a", PARAMS, text="one"), engine.add_request("b", PARAMS, text="two")]
    assert engine.num_live_requests == len(held)
    with pytest.raises(QueueFullError, match="the waiting queue is full"):
        engine.add_request("c", PARAMS, text="three")


async def test_a_stream_dropped_before_iterating_aborts_its_request(engine):
    import gc

    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = engine.add_request("never-read", params, text="the quick brown fox")
    assert engine.has_request("never-read")
    del stream
    gc.collect()
    assert not engine.has_request("never-read")
    await _wait_for_free_blocks(engine)
    assert engine.stats().num_waiting == 0


async def test_a_failing_step_ends_requests_with_an_error_and_frees_blocks(engine):
    def broken_step(scheduler_output):
        raise RuntimeError("device lost")

    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    stream = engine.add_request("doomed", params, text="the quick brown fox")
    first = await anext(stream)
    assert first.finish_reason is None
    engine._engine.model_runner.execute_model = broken_step  # fault injection into the real engine
    rest = [out async for out in stream]
    assert rest[-1].finish_reason == "error"
    assert rest[-1].error == "the engine stopped: device lost"
    await _wait_for_free_blocks(engine)
    with pytest.raises(EngineDeadError, match="the engine stopped: device lost"):
        engine.add_request("after", params, text="hello")
