"""Benchmark workloads are seeded: the same seed gives the same requests, another seed others."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from sluice.bench.workloads import FIRST_PROMPT_TOKEN, BenchRequest, Workload, poisson_arrival_times


def _take(workload: Workload, n: int) -> list[BenchRequest]:
    return list(workload.requests(n))


@pytest.mark.parametrize("kind", ["fixed", "chat", "shared-prefix"])
def test_same_seed_same_requests_other_seed_others(kind: str) -> None:
    make = lambda seed: Workload(kind, vocab_size=1000, seed=seed, input_len=20, output_len=8, prefix_len=32)
    first = _take(make(3), 20)
    assert first == _take(make(3), 20)
    assert [r.prompt_token_ids for r in first] != [r.prompt_token_ids for r in _take(make(4), 20)]
    # Request i is the same whether reached by count or on its own (a --duration run replays it).
    assert make(3).request(17) == first[17]
    assert list(itertools.islice(make(3).requests(None), 20)) == first
    tokens = {t for r in first for t in r.prompt_token_ids}
    assert min(tokens) >= FIRST_PROMPT_TOKEN and max(tokens) < 1000


def test_fixed_lengths_are_exact() -> None:
    for request in Workload("fixed", 100, input_len=33, output_len=7).requests(10):
        assert (len(request.prompt_token_ids), request.output_len) == (33, 7)


def test_shared_prefix_requests_share_exactly_the_prefix() -> None:
    requests = _take(Workload("shared-prefix", 5000, seed=1, input_len=12, output_len=5, prefix_len=64), 8)
    prefix = requests[0].prompt_token_ids[:64]
    assert all(len(r.prompt_token_ids) == 76 and r.prompt_token_ids[:64] == prefix for r in requests)
    assert len({r.prompt_token_ids[64:] for r in requests}) == 8
    other = Workload("shared-prefix", 5000, seed=2, input_len=12, output_len=5, prefix_len=64).request(0)
    assert other.prompt_token_ids[:64] != prefix


def test_chat_lengths_are_log_normal_with_the_given_medians_and_clipped() -> None:
    workload = Workload("chat", 1000, seed=0, input_len=100, output_len=40, sigma=0.5)
    requests = _take(workload, 2000)
    inputs = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.output_len for r in requests]
    assert 90 <= statistics.median(inputs) <= 110 and 36 <= statistics.median(outputs) <= 44
    # log-lengths have standard deviation sigma
    assert statistics.stdev(math.log(n) for n in inputs) == pytest.approx(0.5, abs=0.03)
    clipped = Workload(
        "chat", 1000, input_len=100, output_len=40, sigma=2.0, max_input_len=120, max_output_len=50
    )
    assert all(1 <= len(r.prompt_token_ids) <= 120 and 1 <= r.output_len <= 50 for r in clipped.requests(500))
    assert max(len(r.prompt_token_ids) for r in clipped.requests(500)) == 120


def test_poisson_arrivals_are_seeded_with_the_given_rate() -> None:
    times = list(itertools.islice(poisson_arrival_times(4.0, seed=9), 4001))
    assert times == list(itertools.islice(poisson_arrival_times(4.0, seed=9), 4001))
    assert times != list(itertools.islice(poisson_arrival_times(4.0, seed=10), 4001))
    assert times[0] == 0.0 and all(b > a for a, b in itertools.pairwise(times))
    assert times[-1] / 4000 == pytest.approx(0.25, rel=0.05)
    assert list(itertools.islice(poisson_arrival_times(math.inf, seed=0), 5)) == [0.0] * 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "poem"}, "workload: must be one of"),
        ({"vocab_size": 3}, "vocab_size"),
        ({"input_len": 0}, "input_len"),
        ({"sigma": -1.0}, "sigma"),
    ],
)
def test_bad_workloads_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Workload(**({"kind": "fixed", "vocab_size": 100} | kwargs))
