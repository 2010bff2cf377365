"""Benchmark workloads are seeded: the same seed gives the same requests, another seed others; each run of
a sweep and each warm-up draws prompts of its own, so none is served from the prefix cache."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from sluice.bench.workloads import (
    FIRST_PROMPT_TOKEN,
    BenchRequest,
    Workload,
    poisson_arrival_times,
    run_seed,
)

BLOCK = 16  # a prefix cache serves whole blocks: prompts that differ in their first block share nothing


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


def test_run_seeds_differ_by_run_and_by_seed_and_repeat_for_the_same_pair() -> None:
    seeds = {(seed, run): run_seed(seed, run) for seed in range(20) for run in range(20)}
    assert len(set(seeds.values())) == 400
    assert all(run_seed(seed, run) == value for (seed, run), value in seeds.items())
    assert all(0 <= value < 2**63 for value in seeds.values())
    with pytest.raises(ValueError, match="run_index: must be >= 0"):
        run_seed(0, -1)


@pytest.mark.parametrize("kind", ["fixed", "chat"])
def test_no_two_runs_or_warm_ups_share_a_block_of_prompt(kind: str) -> None:
    base = Workload(kind, vocab_size=1000, seed=3, input_len=40, output_len=8)
    runs = [base.for_run(i) for i in range(4)]
    assert [run.seed for run in runs] == [run_seed(3, i) for i in range(4)]
    assert runs[2] == base.for_run(2) and _take(runs[2], 6) == _take(base.for_run(2), 6)
    first_blocks = [r.prompt_token_ids[:BLOCK] for run in runs for r in _take(run, 8)]
    first_blocks += [run.warmup_request(i).prompt_token_ids[:BLOCK] for run in runs for i in range(2)]
    assert len(set(first_blocks)) == 4 * 8 + 4 * 2
    assert base.shared_prefix_len == 0


def test_warm_ups_have_the_workloads_shape_and_two_output_tokens() -> None:
    workload = Workload("fixed", 1000, seed=1, input_len=33, output_len=7)
    warmup = workload.warmup_request(0)
    assert (len(warmup.prompt_token_ids), warmup.output_len) == (33, 2)
    assert warmup == workload.warmup_request(0) != workload.warmup_request(1)


def test_shared_prefix_runs_share_their_prefix_with_their_warm_up_and_nothing_else() -> None:
    base = Workload("shared-prefix", 5000, seed=1, input_len=12, output_len=5, prefix_len=64)
    assert base.shared_prefix_len == 64
    prefixes = set()
    for run in (base.for_run(0), base.for_run(1)):
        prompts = [r.prompt_token_ids for r in _take(run, 6)] + [run.warmup_request(0).prompt_token_ids]
        assert len({p[:64] for p in prompts}) == 1  # the prefix the workload asks to share
        assert len({p[64:] for p in prompts}) == 7  # the unique suffixes, the warm-up's too
        prefixes.add(prompts[0][:64])
    assert len(prefixes) == 2  # each run has a system prompt of its own
