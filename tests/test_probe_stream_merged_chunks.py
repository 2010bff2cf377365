"""A slow reader's merged outputs are bounded: at most MAX_MERGED_TOKENS tokens each (or its
stream_interval, when larger), the rest in the next ones, in order. Unbounded, a Generate client with
gRPC's default 4 MB receive limit that paused while the engine made 48,000 tokens at logprobs=20 (the
transports buffer about 18,000 one-token chunks, the rest merged) got a 6.3 MB chunk: its call failed with
RESOURCE_EXHAUSTED "Received message larger than max (6312803 vs. 4194304)" and its tokens were lost."""

from __future__ import annotations

import asyncio

from sluice.engine.frontend.request_stream import MAX_MERGED_TOKENS, OutputCollector, RequestStream
from sluice.engine.outputs import RequestOutput

NUM_TOKENS = 2 * MAX_MERGED_TOKENS + 100


def _read_all_after_the_engine_finished(stream_interval: int) -> list[RequestOutput]:
    """Every output of a request whose NUM_TOKENS one-token deltas (the last refused, as the core refuses
    one mid-stream) all came before its reader read any."""

    async def run() -> list[RequestOutput]:
        collector = OutputCollector(stream_interval)
        for token in range(NUM_TOKENS):
            collector.put(RequestOutput("r", (token,), f"<{token}>"))
        refusal = RequestOutput("r", (), "", finish_reason="error", error="x: y", invalid_field="x")
        collector.put(refusal)
        return [output async for output in RequestStream("r", collector, lambda *_: None)]

    return asyncio.run(run())


def test_a_slow_readers_merged_outputs_hold_at_most_max_merged_tokens() -> None:
    outputs = _read_all_after_the_engine_finished(stream_interval=1)
    assert [len(output.token_ids) for output in outputs] == [MAX_MERGED_TOKENS, MAX_MERGED_TOKENS, 100, 0]
    tokens = [token for output in outputs for token in output.token_ids]
    assert tokens == list(range(NUM_TOKENS))
    assert "".join(output.text for output in outputs) == "".join(f"<{t}>" for t in range(NUM_TOKENS))
    assert [output.finish_reason for output in outputs] == [None, None, None, "error"]
    assert outputs[-1].invalid_field == "x"


def test_a_stream_interval_past_the_bound_still_gets_its_tokens_per_output() -> None:
    interval = MAX_MERGED_TOKENS + 50
    outputs = _read_all_after_the_engine_finished(stream_interval=interval)
    assert interval * 2 == NUM_TOKENS
    assert [len(output.token_ids) for output in outputs] == [interval, interval, 0]
    assert [token for output in outputs for token in output.token_ids] == list(range(NUM_TOKENS))
