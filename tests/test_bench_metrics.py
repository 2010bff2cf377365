"""Serving metrics on a hand-made timeline whose TTFT, TPOT, ITL, percentiles and goodput are known."""

from __future__ import annotations

import random

import numpy
import pytest

from sluice.bench.metrics import (
    Distribution,
    RequestRecord,
    RunMetrics,
    Slo,
    percentile,
    summarize,
    unexpected_cache_hits,
)

#   A: sent 0.0, chunks at 0.5 0.6 0.8 1.1, 4 tokens  -> TTFT 0.5, E2E 1.1, TPOT 0.6/3, ITL .1 .2 .3
#   B: sent 1.0, chunks at 1.2 (1 tok), 2.2 (4 tok)   -> TTFT 0.2, E2E 1.2, TPOT 1.0/4, ITL 1.0
#   C: sent 1.5, RESOURCE_EXHAUSTED
#   D: sent 2.0, one chunk at 2.3, 1 token            -> TTFT 0.3, E2E 0.3, no TPOT, no ITL
#   E: sent 3.0, no chunk and no end (cut off)        -> INCOMPLETE


def _timeline() -> list[RequestRecord]:
    return [
        RequestRecord(0, 10, 0.0, [0.5, 0.6, 0.8, 1.1], 4, 1.1),
        RequestRecord(1, 20, 1.0, [1.2, 2.2], 5, 2.2),
        RequestRecord(2, 30, 1.5, error="RESOURCE_EXHAUSTED"),
        RequestRecord(3, 40, 2.0, [2.3], 1, 2.3),
        RequestRecord(4, 50, 3.0),
    ]


def test_per_request_latencies() -> None:
    a, b, _, d, _ = _timeline()
    assert (a.ttft, a.e2e, a.tpot) == pytest.approx((0.5, 1.1, 0.2))
    assert a.itls == pytest.approx([0.1, 0.2, 0.3])
    assert (b.ttft, b.e2e, b.tpot) == pytest.approx((0.2, 1.2, 0.25))
    assert b.itls == pytest.approx([1.0])
    assert d.tpot is None and d.itls == []


def test_summary_of_the_timeline() -> None:
    m = summarize(_timeline(), duration_seconds=4.0)
    assert (m.num_requests, m.num_completed) == (5, 3)
    assert m.errors == {"INCOMPLETE": 1, "RESOURCE_EXHAUSTED": 1}
    assert (m.prompt_tokens, m.output_tokens) == (70, 10)
    assert m.request_throughput == pytest.approx(0.75)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(20.0)
    assert m.goodput is None
    # TTFT samples 0.2 0.3 0.5: p90 rank 1.8 -> 0.3 + 0.8 * 0.2; p99 rank 1.98 -> 0.3 + 0.98 * 0.2
    assert (m.ttft.count, m.ttft.mean, m.ttft.p50) == (3, pytest.approx(1 / 3), pytest.approx(0.3))
    assert (m.ttft.p90, m.ttft.p99) == pytest.approx((0.46, 0.496))
    # ITL pooled over requests: 0.1 0.2 0.3 1.0 -> p50 rank 1.5 = 0.25, p99 rank 2.97 = 0.3 + 0.97 * 0.7
    assert (m.itl.count, m.itl.p50, m.itl.p99) == (4, pytest.approx(0.25), pytest.approx(0.979))
    assert (m.tpot.count, m.tpot.mean) == (2, pytest.approx(0.225))
    assert (m.e2e.count, m.e2e.p50, m.e2e.mean) == (3, pytest.approx(1.1), pytest.approx(2.6 / 3))


@pytest.mark.parametrize(
    ("slo", "goodput"),
    [
        (Slo(ttft=0.4, tpot=0.22), 0.25),  # only D: A misses TTFT, B misses TPOT; D has no TPOT
        (Slo(ttft=0.4), 0.5),  # B and D
        (Slo(tpot=0.21), 0.5),  # A (TPOT 0.2) and D
        (Slo(ttft=0.1, tpot=1.0), 0.0),
        (Slo(ttft=10.0, tpot=10.0), 0.75),  # every completed request; never the failed ones
    ],
)
def test_goodput_counts_requests_meeting_both_slos(slo: Slo, goodput: float) -> None:
    assert summarize(_timeline(), 4.0, slo).goodput == pytest.approx(goodput, abs=1e-9)


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = random.Random(7)
    values = [rng.expovariate(3.0) for _ in range(101)]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)), rel=1e-12)
    assert percentile(list(range(1, 102)), 99) == 100
    assert percentile([4.0], 99) == 4.0


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q: must be in"):
        percentile([1.0], 101)


def test_no_samples_give_empty_distributions_and_round_trip() -> None:
    m = summarize([RequestRecord(0, 5, 0.0, error="UNAVAILABLE")], 1.0, Slo(ttft=1.0))
    assert m.ttft == Distribution(0, None, None, None, None)
    assert (m.num_completed, m.goodput, m.errors) == (0, 0.0, {"UNAVAILABLE": 1})
    full = summarize(_timeline(), 4.0)
    assert RunMetrics.from_dict(full.to_dict()) == full
    with pytest.raises(ValueError, match="duration_seconds"):
        summarize([], 0.0)


def test_prompt_tokens_split_into_cached_and_computed_as_the_server_reports_them() -> None:
    records = _timeline()
    records[0].cached_tokens, records[0].prompt_tokens_computed = 0, 10
    records[1].cached_tokens, records[1].prompt_tokens_computed = 16, 4
    records[2].cached_tokens = 30  # failed: not counted
    m = summarize(records, 4.0)
    # D completed without a report: the sums are over the requests that reported
    assert (m.prompt_tokens, m.cached_prompt_tokens, m.computed_prompt_tokens) == (70, 16, 14)
    assert RunMetrics.from_dict(m.to_dict()) == m
    assert summarize(_timeline(), 4.0).cached_prompt_tokens is None  # a server that reports nothing


def test_a_request_is_an_unexpected_cache_hit_when_served_more_than_the_shared_prefix() -> None:
    records = _timeline()
    for record, cached in zip(records, (0, 16, None, 32, None), strict=True):
        record.cached_tokens = cached
    assert unexpected_cache_hits(records, shared_prefix_len=0) == 2
    assert unexpected_cache_hits(records, shared_prefix_len=16) == 1
    assert unexpected_cache_hits(records, shared_prefix_len=32) == 0
