"""The benchmarks' own percentiles interpolate as numpy does (and `sluice bench` reports), and a turn
without a TTFT does not scramble the fleet benchmark's: sorted() with a NaN in it leaves the list unsorted."""

from __future__ import annotations

import math
import random

import numpy
import pytest

from sluice.benchmarks.engine.host_overhead import quantile
from sluice.benchmarks.serving.fleet_smg import PolicyResult, Turn


@pytest.mark.parametrize("num_steps", [10, 40, 41, 7])
def test_host_p90_interpolates_as_numpy(num_steps: int) -> None:
    values = random.Random(num_steps).sample(range(100_000), num_steps)  # microseconds a step
    assert quantile(values, 0.9) == pytest.approx(float(numpy.percentile(values, 90)), rel=1e-12)
    assert quantile(list(range(10)), 0.9) == pytest.approx(8.1)  # not 9: the maximum of ten


def test_fleet_ttft_percentiles_interpolate_and_skip_turns_without_content() -> None:
    rng = random.Random(3)
    ttfts = [rng.uniform(0.01, 2.0) for _ in range(30)]
    turns = [Turn(100, 50, t) for t in ttfts]
    turns.insert(4, Turn(100, 50, math.nan))  # an answer that streamed no content
    result = PolicyResult.of("round_robin", turns, 12.0, (16, 15))
    assert result.num_requests == 31
    assert result.ttft_p50_ms == pytest.approx(1000 * float(numpy.percentile(ttfts, 50)), rel=1e-12)
    assert result.ttft_p90_ms == pytest.approx(1000 * float(numpy.percentile(ttfts, 90)), rel=1e-12)
    assert (result.prompt_tokens, result.prompt_tokens_computed) == (3100, 1550)
