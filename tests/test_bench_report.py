"""`sluice bench compare` ratios, the table's prefix-cache columns and warnings, and the runner's arrival
logic (concurrency cap, duration)."""

from __future__ import annotations

import asyncio
import json

import pytest

from sluice.bench.metrics import RequestRecord, summarize
from sluice.bench.report import compare, format_runs, run_document, write_json
from sluice.bench.runner import LoadConfig, run_load
from sluice.bench.transports import Chunk
from sluice.bench.workloads import BenchRequest, Workload
from sluice.service.cli import main


def _records(scale: float, cached: tuple[int | None, ...] = (None,) * 4) -> list[RequestRecord]:
    """4 one-second requests of 24 prompt tokens whose chunk gaps are all `scale` * 0.1 s; `cached` of
    each prompt's tokens served from the prefix cache."""
    return [
        RequestRecord(i, 24, float(i), [i + scale * 0.1 * k for k in range(1, 5)], 4, i + scale * 0.4, None,
                      c, None if c is None else 24 - c)
        for i, c in enumerate(cached)
    ]  # fmt: skip


def _document(label: str, scale: float, path, cached: tuple[int | None, ...] = (None,) * 4) -> None:
    records = _records(scale, cached)
    metrics = summarize(records, duration_seconds=4.0 * scale)
    write_json(str(path), [run_document(label, {"concurrency": 1}, metrics, records)])


def test_compare_prints_b_over_a(tmp_path, capsys) -> None:
    _document("base", 1.0, tmp_path / "a.json")
    _document("slow", 2.0, tmp_path / "b.json")
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    rows = {line[:28].strip(): line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    # B takes twice as long: half the throughput, twice every latency.
    assert rows["request throughput (req/s)"][-3:] == ["1.00", "0.50", "0.50x"]
    assert rows["output throughput (tok/s)"][-3:] == ["4.00", "2.00", "0.50x"]
    assert rows["TTFT p50 (ms)"][-3:] == ["100.00", "200.00", "2.00x"]
    assert rows["ITL p99 (ms)"][-3:] == ["100.00", "200.00", "2.00x"]
    assert rows["E2E p99 (ms)"][-3:] == ["400.00", "800.00", "2.00x"]
    assert rows["goodput (req/s)"][-3:] == ["-", "-", "-"]


def test_the_table_flags_a_run_served_from_the_cache_beyond_its_shared_prefix(tmp_path, capsys) -> None:
    honest, cached = _records(1.0, (0, 0, 0, 0)), _records(1.0, (0, 0, 0, 0))
    cached[2].cached_tokens, cached[2].prompt_tokens_computed = 16, 8  # one request hit the cache...
    runs = [
        run_document("honest", {}, summarize(honest, 4.0), honest),
        run_document("cached", {}, summarize(cached, 4.0), cached),
        run_document("shared prefix", {}, summarize(cached, 4.0), cached, shared_prefix_len=16),
    ]
    # ...which a workload sharing no prefix does not explain; one sharing 16 tokens does
    assert [(r["cache_hits_unexpected"], r["num_unexpected_cache_hits"]) for r in runs] == [
        (False, 0), (True, 1), (False, 0)
    ]  # fmt: skip
    assert [r["requests"][2]["cached_tokens"] for r in runs] == [0, 16, 16]
    lines = format_runs(runs).splitlines()
    assert lines[0].split()[:5] == ["run", "done", "prompt", "cached", "computed"]
    assert lines[1].split()[1:5] == ["4/4", "96", "0", "96"]
    assert lines[2].split()[1:5] == ["4/4", "96", "16!", "80"]
    assert lines[3].split()[2:6] == ["4/4", "96", "16", "80"]  # "shared prefix" is two words
    assert lines[4:] == [
        "warning: cached: 1 requests hit the prefix cache (16 of 96 prompt tokens cached) although the "
        "workload shares no prefix: its TTFT and throughput measure the cache, not the engine (the server "
        "has seen these prompts: restart it or pass another --seed)"
    ]
    _document("base", 1.0, tmp_path / "a.json", (0, 0, 0, 0))
    _document("again", 1.0, tmp_path / "b.json", (0, 0, 16, 0))
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("B: warning: again: 1 requests hit the prefix")


def test_compare_needs_paired_runs(tmp_path) -> None:
    _document("base", 1.0, tmp_path / "a.json")
    with pytest.raises(ValueError, match="must pair up"):
        compare(json.loads((tmp_path / "a.json").read_text())["runs"], [{}, {}])


class _Clock:
    """A transport whose every request takes `seconds`; records how many were ever in flight at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.in_flight, self.max_in_flight, self.ids = seconds, 0, 0, []

    async def generate(self, request_id: str, request: BenchRequest):
        self.ids.append(request_id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for _ in range(request.output_len):
                await asyncio.sleep(self.seconds / request.output_len)
                yield Chunk(1)
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        pass


async def test_closed_loop_keeps_exactly_the_concurrency_in_flight() -> None:
    clock = _Clock(0.02)
    workload = Workload("fixed", 100, input_len=4, output_len=3)
    result = await run_load(clock, workload, LoadConfig(num_requests=10, concurrency=3, warmup_requests=2))
    assert clock.max_in_flight == 3
    assert sum(i.startswith("warmup-") for i in clock.ids) == 2
    m = result.metrics
    assert (m.num_completed, m.output_tokens, m.itl.count) == (10, 30, 20)
    assert m.duration_seconds >= 0.08  # 10 requests, 3 at a time, 20 ms each: 4 waves at least


async def test_duration_stops_sending_and_waits_for_requests_in_flight() -> None:
    clock = _Clock(0.05)
    load = LoadConfig(duration=0.12, concurrency=2, warmup_requests=0)
    result = await run_load(clock, Workload("fixed", 100, input_len=4, output_len=2), load)
    # Each of the 2 slots sends at 0, then after each 0.05 s request: at most 3 each before 0.12 s (fewer
    # on a busy machine, none after a stall of 0.12 s before the first).
    assert result.metrics.num_requests <= 6
    assert result.metrics.num_completed == result.metrics.num_requests
    assert all(r.start < 0.12 for r in result.records)
    assert clock.in_flight == 0


def test_load_config_is_validated() -> None:
    with pytest.raises(ValueError, match="exactly one of num_requests and duration"):
        LoadConfig()
    with pytest.raises(ValueError, match="duration: needs a finite request_rate or a concurrency"):
        LoadConfig(duration=1.0)
    with pytest.raises(ValueError, match="concurrency"):
        LoadConfig(num_requests=1, concurrency=0)
