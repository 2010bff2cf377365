"""`sluice bench` measures the engine, not its prefix cache: against a real server on a loopback port, a
sweep's runs and warm-ups draw prompts of their own, so the server serves none from its cache (it says so
in each response's Usage); a run that is served from the cache is flagged in the JSON and the table."""

from __future__ import annotations

import json

from service_harness import ServerThread, bench_load

from sluice.bench.report import run_document
from sluice.bench.runner import LoadConfig
from sluice.bench.workloads import Workload
from sluice.service.cli import main

# 40-token prompts fill two 16-token blocks: a prompt the server has seen is a 32-token prefix-cache hit.
SWEEP = ["--sweep", "1,4", "--num-requests", "8", "--input-len", "40", "--output-len", "4", "--seed", "7"]


def _sweep(server: ServerThread, path) -> list[dict]:
    assert main(["bench", "--target", server.target, "--no-progress", *SWEEP, "--json", str(path)]) == 0
    return json.loads(path.read_text())["runs"]


def test_a_sweep_reads_nothing_from_the_cache_and_the_same_sweep_again_is_flagged(
    server: ServerThread, tmp_path, capsys
) -> None:
    runs = _sweep(server, tmp_path / "first.json")
    assert [r["label"] for r in runs] == ["concurrency 1", "concurrency 4"]
    for run in runs:
        m = run["metrics"]
        assert (m["prompt_tokens"], m["cached_prompt_tokens"], m["computed_prompt_tokens"]) == (320, 0, 320)
        assert [r["cached_tokens"] for r in run["requests"]] == [0] * 8
        assert run["cache_hits_unexpected"] is False and run["num_unexpected_cache_hits"] == 0
    first = capsys.readouterr().out
    assert "cached" in first.splitlines()[0] and "warning" not in first

    # The same --seed against the same server: every prompt is one it has seen. Each request reads its
    # two full blocks from the cache and computes the last 8 tokens; both runs are flagged.
    again = _sweep(server, tmp_path / "again.json")
    for run in again:
        m = run["metrics"]
        assert (m["prompt_tokens"], m["cached_prompt_tokens"], m["computed_prompt_tokens"]) == (320, 256, 64)
        assert [r["cached_tokens"] for r in run["requests"]] == [32] * 8
        assert run["cache_hits_unexpected"] is True and run["num_unexpected_cache_hits"] == 8
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[4] for line in table[1:3]] == ["256!", "256!"]  # "concurrency N" is two words
    assert table[3:] == [
        f"warning: concurrency {c}: 8 requests hit the prefix cache (256 of 320 prompt tokens cached) "
        "although the workload shares no prefix: its TTFT and throughput measure the cache, not the engine "
        "(the server has seen these prompts: restart it or pass another --seed)"
        for c in (1, 4)
    ]
    server.wait_idle()


def test_without_a_seed_no_command_replays_anothers_prompts(server: ServerThread, tmp_path, capsys) -> None:
    """With a fixed default seed, changing only --output-len (or --input-len: a shorter prompt was a
    prefix of the longer) replayed the last command's prompts, served from the cache: a wasted run."""
    seeds = []
    for output_len in ("4", "6"):
        path = tmp_path / f"out{output_len}.json"
        args = ["--num-requests", "4", "--input-len", "40", "--output-len", output_len, "--json", str(path)]
        assert main(["bench", "--target", server.target, "--no-progress", *args]) == 0
        (run,) = json.loads(path.read_text())["runs"]
        assert run["metrics"]["cached_prompt_tokens"] == 0 and run["cache_hits_unexpected"] is False
        seeds.append(run["config"]["seed"])
        assert f"prompts drawn with --seed {seeds[-1]}" in capsys.readouterr().err  # to replay them
    assert seeds[0] != seeds[1]
    server.wait_idle()


def test_a_shared_prefix_run_is_flagged_when_judged_without_its_shared_prefix(server: ServerThread) -> None:
    workload = Workload("shared-prefix", 512, seed=11, input_len=8, output_len=2, prefix_len=32)
    result = bench_load(server.target, workload, LoadConfig(num_requests=4, concurrency=2))
    # The warm-up computed the 32-token system prompt; each request reads it and computes its suffix.
    assert [(r.cached_tokens, r.prompt_tokens_computed) for r in result.records] == [(32, 8)] * 4
    assert (result.metrics.cached_prompt_tokens, result.metrics.computed_prompt_tokens) == (128, 32)
    exempt = run_document("shared", {}, result.metrics, result.records, shared_prefix_len=32)
    judged_as_fixed = run_document("shared", {}, result.metrics, result.records)
    assert (exempt["cache_hits_unexpected"], judged_as_fixed["cache_hits_unexpected"]) == (False, True)
    assert judged_as_fixed["num_unexpected_cache_hits"] == 4
    server.wait_idle()
