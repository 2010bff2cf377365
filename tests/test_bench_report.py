"""`sluice bench compare` ratios, and the runner's arrival logic (concurrency cap, duration)."""

from __future__ import annotations

import asyncio
import json

import pytest

from sluice.bench.metrics import RequestRecord, summarize
from sluice.bench.report import compare, run_document, write_json
from sluice.bench.runner import LoadConfig, run_load
from sluice.bench.workloads import BenchRequest, Workload
from sluice.service.cli import main


def _document(label: str, scale: float, path) -> None:
    """One run of 4 one-second requests whose chunk gaps are all `scale` * 0.1 s."""
    records = [
        RequestRecord(i, 8, float(i), [i + scale * 0.1 * k for k in range(1, 5)], 4, i + scale * 0.4)
        for i in range(4)
    ]
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
                yield 1
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
    # Each of the 2 slots sends at 0, then after each 0.05 s request: at most 3 each before 0.12 s, and
    # on a busy machine one slot may send its third in time while the other does not (5).
    assert 2 <= result.metrics.num_requests <= 6
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
