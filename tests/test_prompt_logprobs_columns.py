"""Prompt logprobs as columns (`PromptLogprobs`): read as a sequence of `Logprobs`, carried in the core's
message, and collected by `PromptLogprobsTracker` over chunks, a recompute after preemption overwriting."""

from __future__ import annotations

import msgspec
import pytest

from sluice.engine.core.prompt_logprobs_tracker import PromptLogprobsTracker
from sluice.engine.messages import CoreOutput
from sluice.engine.outputs import Logprobs, PromptLogprobs, TokenLogprob
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.scheduler_output import PromptLogprobsSlice

TWO_TOP = PromptLogprobs(
    [7, 8, 9], [-1.0, -2.0, -3.0], 2, [7, 1, 2, 8, 9, 3], [-1.0, -1.5, -0.5, -2.0, -0.25, -4.0]
)


def test_columns_read_as_one_logprobs_per_prompt_token() -> None:
    entries = [
        Logprobs(TokenLogprob(7, -1.0), (TokenLogprob(7, -1.0), TokenLogprob(1, -1.5))),
        Logprobs(TokenLogprob(8, -2.0), (TokenLogprob(2, -0.5), TokenLogprob(8, -2.0))),
        Logprobs(TokenLogprob(9, -3.0), (TokenLogprob(9, -0.25), TokenLogprob(3, -4.0))),
    ]
    assert list(TWO_TOP) == entries and len(TWO_TOP) == 3 and TWO_TOP
    assert TWO_TOP[-1] == entries[2] and TWO_TOP[1] == entries[1]
    with pytest.raises(IndexError):
        TWO_TOP[3]
    assert list(PromptLogprobs([5], [-0.5])) == [Logprobs(TokenLogprob(5, -0.5), ())]
    assert not PromptLogprobs([], [], 2)


def test_columns_cross_in_the_cores_message() -> None:
    output = CoreOutput("r", [4], None, 0, 0, None, None, prompt_logprobs=TWO_TOP)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(output), type=CoreOutput)
    assert decoded.prompt_logprobs == TWO_TOP and list(decoded.prompt_logprobs) == list(TWO_TOP)


def _columns(start: int, end: int, offset: float) -> PromptLogprobs:
    """Entries of positions [start, end) with two top each; `offset` tells one computation from another."""
    positions = range(start, end)
    tops = [t for p in positions for t in (p, p + 100)]
    return PromptLogprobs(
        [p + 1 for p in positions], [-p - offset for p in positions], 2, tops, [-t - offset for t in tops]
    )


def test_chunks_are_collected_in_order_and_a_recompute_after_preemption_overwrites() -> None:
    request = Request("r", list(range(1, 12)), SamplingParams(prompt_logprobs=2), frozenset(), 0.0)
    tracker = PromptLogprobsTracker()

    def step(start: int, end: int, offset: float) -> None:
        piece = PromptLogprobsSlice("r", 0, start, tuple(range(start + 1, end + 1)), 2)
        tracker.add([piece], {"r": _columns(start, end, offset)})

    step(0, 4, 0.0)
    step(4, 8, 0.0)
    step(0, 6, 0.5)  # preempted, recomputed from the start with other numbers: positions 6, 7 are dropped
    step(6, 10, 0.5)
    taken = tracker.take(request)
    assert taken == _columns(0, 10, 0.5)
    assert tracker.take(request) is None  # once
