"""A request id reused at once after its stream ended (abandoned, aborted, or ended here by a stop string):
the core's answer to the abort the frontend sent (an "abort" output, a step later) belongs to the earlier
request, and must neither end the new one nor leave the new one running in the core with no stream to
read it. (It did both: the new request ended "abort" with no tokens while the core ran it on, and the next
request of that id was refused INVALID_ARGUMENT "already in use".)"""

from __future__ import annotations

import pytest
from test_async_engine import PARAMS, UNENDING, _config, _wait_for_free_blocks

from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.engine.sampling_params import SamplingParams


@pytest.fixture
async def engine(llama_long_dir):
    engine = AsyncEngine(_config(llama_long_dir), engine_timeout=3600.0)
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.mark.parametrize("old_n", [1, 3])
async def test_an_id_reused_right_after_its_stream_was_abandoned_runs_the_new_request(engine, old_n):
    old = await engine.add_request("again", _n(old_n), text="a b c")
    assert (await anext(old)).token_ids  # running in the core
    await old.aclose()  # the caller left: the abort is on its way to the core, its answer not back yet
    new = await engine.add_request("again", PARAMS, text="the quick brown fox")
    outputs = [output async for output in new]
    assert [o.finish_reason for o in outputs][-1] == "length"
    assert {o.index for o in outputs} == {0}
    assert sum(len(o.token_ids) for o in outputs) == PARAMS.max_tokens
    await _wait_for_free_blocks(engine)
    assert engine.num_live_requests == 0


async def test_an_id_reused_right_after_an_abort_runs_the_new_request(engine):
    old = await engine.add_request("again", UNENDING, text="a b c")
    assert (await anext(old)).token_ids
    await engine.abort("again")
    await old.aclose()
    new = await engine.add_request("again", PARAMS, text="the quick brown fox")
    outputs = [output async for output in new]
    assert outputs[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in outputs) == PARAMS.max_tokens
    await _wait_for_free_blocks(engine)


async def test_an_id_reused_right_after_a_stop_string_ended_its_request_runs_the_new_request(engine):
    # The stop string ends the request here; the core, which runs it on until the abort this sends
    # arrives, answers that abort with an "abort" output for the id.
    probe = [output async for output in await engine.add_request("probe", PARAMS, text="a b c")]
    text = "".join(output.text for output in probe)
    stop = text[len(text) // 2 :][:2]
    assert stop
    stopped = SamplingParams(temperature=0.0, max_tokens=UNENDING.max_tokens, ignore_eos=True, stop=[stop])
    old = [output async for output in await engine.add_request("again", stopped, text="a b c")]
    assert (old[-1].finish_reason, old[-1].stop_reason) == ("stop", stop)
    new = await engine.add_request("again", PARAMS, text="a b c")
    outputs = [output async for output in new]
    assert outputs[-1].finish_reason == "length"
    assert [t for o in outputs for t in o.token_ids] == [t for o in probe for t in o.token_ids]
    await _wait_for_free_blocks(engine)


def _n(n: int) -> SamplingParams:
    if n == 1:
        return UNENDING
    return SamplingParams(temperature=0.8, seed=1, n=n, max_tokens=UNENDING.max_tokens, ignore_eos=True)
