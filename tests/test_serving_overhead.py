"""`python -m sluice.benchmarks.serving.serving_overhead`: both sides run the embedded model on the same
prompts, and the tables say where each run's CPU went: per output token, and in cores busy per process
beside the machine's idle cores (from /proc/stat)."""

from __future__ import annotations

import json
import os

import pytest

from sluice.benchmarks.serving import serving_overhead as bench

TICKS = os.sysconf("SC_CLK_TCK")


def side(name: str, cpu_seconds: dict[str, float], idle: float | None) -> bench.Side:
    return bench.Side(name, 16, 128, 8192, 9.5, 400.0, 0, cpu_seconds, 10.0, idle)  # 9.5 s timed in 10


def test_idle_cpu_seconds_are_idle_plus_iowait_of_the_total_line():
    assert bench.idle_cpu_seconds(f"cpu  100 7 50 {4 * TICKS} {TICKS} 0 3 0 0 0") == 5.0
    with pytest.raises(ValueError, match="total line"):
        bench.idle_cpu_seconds("cpu0 100 7 50 400 100 0 3 0 0 0")


def test_machine_samples_give_wall_and_idle_seconds_between_them():
    earlier, later = bench.MachineSample(1.0, 20.0), bench.MachineSample(3.5, 20.5)
    assert later.since(earlier) == (2.5, 0.5)
    assert later.since(bench.MachineSample(1.0, None)) == (2.5, None)


def test_cores_table_divides_each_process_and_the_idle_cpu_by_the_run():
    offline = side("offline LLM", {"offline": 19.8}, 0.1)
    grpc = side("sluice serve (gRPC)", {"client": 0.4, "frontend": 0.5, "core": 18.5}, None)
    rows = bench.format_cores_table([(offline, grpc)]).splitlines()
    assert rows[0].split("|")[2:-1] == [
        " offline ",
        " idle (offline) ",
        " gRPC core ",
        " frontend ",
        " client ",
        " idle (gRPC) ",
    ]
    assert rows[2] == "| 16 | 1.98 | 0.01 | 1.85 | 0.05 | 0.04 | - |"


def test_a_short_run_reports_every_process_and_the_idle_cpus(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    args = ["--concurrency", "2", "--rounds", "1", "--min-requests", "2", "--input-len", "8"]
    bench.main([*args, "--output-len", "3", "--json", str(out)])
    offline, grpc = json.loads(out.read_text())
    assert (offline["output_tokens"], grpc["output_tokens"]) == (6, 6)
    assert set(grpc["cpu_seconds"]) == {"client", "frontend", "core"}
    for run in (offline, grpc):
        assert run["window_seconds"] >= run["seconds"] > 0
        # /proc/stat counts in clock ticks: a reading may be up to a tick late on each CPU
        assert 0 <= run["idle_cpu_seconds"] <= (os.cpu_count() or 1) * (run["window_seconds"] + 1 / TICKS)
    printed = capsys.readouterr().out
    assert "Cores busy during each run, per process, and the machine's idle cores" in printed
