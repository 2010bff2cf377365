"""`python -m sluice.benchmarks.engine.offline`: both sides run the same checkpoint and workload; JSON holds
every run."""

from __future__ import annotations

import json

from sluice.benchmarks.engine import offline as bench


def test_throughput_bench_compares_sluice_with_transformers_on_the_same_workload(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--num-requests", "3", "--output-len", "4", "--json", str(out)])
    results = json.loads(out.read_text())
    assert [r["name"] for r in results] == [
        "sluice",
        "transformers sequential",
        "transformers static batch 8",
    ]
    assert [r["output_tokens"] for r in results] == [12, 12, 12]
    assert all(r["tokens_per_second"] > 0 for r in results)
    assert results[0]["ttft_mean"] is not None and results[1]["ttft_mean"] is None
    printed = capsys.readouterr().out
    assert "Throughput (output tokens/s; ratio vs transformers sequential)" in printed
    assert "transformers sequential" in printed and "1.00x" in printed


def test_workloads_are_seeded_and_shaped():
    mixed = bench.mixed_workload(5, 100, seed=3)
    assert mixed == bench.mixed_workload(5, 100, seed=3) != bench.mixed_workload(5, 100, seed=4)
    assert all(32 <= len(p) <= 512 and all(3 <= t < 100 for t in p) for p in mixed)
    agent = bench.agent_workload(4, 100, seed=0, system_len=20)
    assert all(p[:20] == agent[0][:20] and 52 <= len(p) <= 148 for p in agent)
