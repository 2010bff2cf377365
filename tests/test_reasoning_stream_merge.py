"""Merged deltas keep their reasoning: a reader slower than the engine, or a stream_interval above one,
gets several deltas as one output, whose `reasoning` holds all of theirs, as its `text` does (it kept only
the newest delta's: a client lost the reasoning of every merged delta)."""

from __future__ import annotations

import asyncio

from sluice.engine.frontend.request_stream import OutputCollector
from sluice.engine.outputs import RequestOutput


def test_merged_deltas_keep_every_reasoning_delta() -> None:
    async def merged() -> RequestOutput:
        collector = OutputCollector(stream_interval=3)
        deltas = [("ab", ""), ("c", ""), ("", "x")]
        for i, (reasoning, text) in enumerate(deltas):
            finish = "stop" if i == len(deltas) - 1 else None
            collector.put(RequestOutput("r", (i,), text, reasoning=reasoning, finish_reason=finish))
        return await collector.get()

    output = asyncio.run(merged())
    assert (output.token_ids, output.reasoning, output.text) == ((0, 1, 2), "abc", "x")
