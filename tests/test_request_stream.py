"""OutputCollector / RequestStream: deltas merged per sample, oldest sample first, the stream ending
after every sample's last output, and closing exactly once."""

from __future__ import annotations

import asyncio

from sluice.engine.frontend.request_stream import OutputCollector, RequestStream
from sluice.engine.outputs import Logprobs, RequestOutput, TokenLogprob

PROMPT_LOGPROBS = (Logprobs(TokenLogprob(5, -1.0)),)


def _out(index: int, token: int, finish: str | None = None, **kw: object) -> RequestOutput:
    return RequestOutput("r", (token,), f"t{token}", finish_reason=finish, index=index, **kw)


def test_samples_are_merged_separately_and_the_stream_ends_after_all_finished():
    async def run() -> tuple[list[tuple[int, tuple[int, ...], str, str | None, int]], list[tuple[str, bool]]]:
        collector = OutputCollector()
        closed: list[tuple[str, bool]] = []
        stream = RequestStream("r", collector, lambda rid, done: closed.append((rid, done)), num_samples=2)
        collector.put(_out(0, 1, prompt_logprobs=PROMPT_LOGPROBS))
        collector.put(_out(1, 2))
        collector.put(_out(0, 3))
        collector.put(_out(1, 4, "length"))
        collector.put(_out(0, 5, "stop"))
        seen = []
        async for output in stream:
            seen.append(
                (
                    output.index,
                    output.token_ids,
                    output.text,
                    output.finish_reason,
                    len(output.prompt_logprobs),
                )
            )
            assert closed == ([] if len(seen) < 2 else [("r", True)])
        return seen, closed

    seen, closed = asyncio.run(run())
    assert seen == [(0, (1, 3, 5), "t1t3t5", "stop", 1), (1, (2, 4), "t2t4", "length", 0)]
    assert closed == [("r", True)]


def test_stream_interval_waits_per_sample():
    async def run() -> list[tuple[int, tuple[int, ...]]]:
        collector = OutputCollector(stream_interval=2)
        collector.put(_out(0, 1))
        collector.put(_out(1, 2))
        collector.put(_out(1, 3))  # sample 1 holds 2 tokens: ready; sample 0 (1 token) is not
        first = await asyncio.wait_for(collector.get(), 60.0)
        collector.put(_out(0, 4))
        second = await asyncio.wait_for(collector.get(), 60.0)
        return [(first.index, first.token_ids), (second.index, second.token_ids)]

    assert asyncio.run(run()) == [(1, (2, 3)), (0, (1, 4))]


def test_a_failure_is_raised_after_every_pending_sample_was_taken():
    async def run() -> tuple[list[int], str]:
        collector = OutputCollector(stream_interval=4)
        collector.put(_out(0, 1))
        collector.put(_out(1, 2))
        collector.fail(RuntimeError("core died"))
        indices = [(await collector.get()).index, (await collector.get()).index]
        try:
            await collector.get()
        except RuntimeError as exc:
            return indices, str(exc)
        return indices, ""

    assert asyncio.run(run()) == ([0, 1], "core died")


def test_a_refusal_is_not_merged_into_the_tokens_before_it():
    """A request refused after it streamed (invalid_field: the caller gets a status, no chunk from that
    output) keeps the tokens it streamed before, however slow its reader: they come first, then the
    refusal on its own."""

    async def run() -> list[tuple[tuple[int, ...], str | None, str | None]]:
        collector = OutputCollector()
        collector.put(_out(0, 1))
        collector.put(_out(0, 2))
        refusal = RequestOutput("r", (), "", finish_reason="error", error="x: y", invalid_field="x")
        collector.put(refusal)  # all three put before the reader reads
        stream = RequestStream("r", collector, lambda rid, done: None)
        return [(o.token_ids, o.finish_reason, o.invalid_field) async for o in stream]

    assert asyncio.run(run()) == [((1, 2), None, None), ((), "error", "x")]
