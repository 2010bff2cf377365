"""`python -m sluice.benchmarks.engine.cpu_race`: each engine's runner counts the tokens it produced; the
table's ratios are Sluice's rate over each other engine's (over rounds, the median of each round's own ratio);
each round runs on prompts Sluice's prefix cache has not seen; each Sluice fp32 run is set against the floor
(benchmarks/engine/machine_limits.py) probed right before it; a missing llama-cpp-python is reported, not
fatal."""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
import types

import pytest
import torch

from sluice.benchmarks.engine import cpu_race as race
from sluice.benchmarks.engine import machine_limits as limits
from sluice.engine.frontend.llm import LLM


def test_runners_decode_every_requested_token(llama_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    prompts = race.make_prompts(3, 8, vocab_size=512, seed=0)
    assert prompts == race.make_prompts(3, 8, vocab_size=512, seed=0)
    assert len(prompts) == 3 and all(len(p) == 8 and all(3 <= t < 512 for t in p) for p in prompts)
    llm = LLM(llama_dir, dtype="float32", num_blocks=16)
    clock = iter([100.0, 102.5])  # the run's wall clock, as the runner reads it: 2.5 s
    start = time.perf_counter()
    with monkeypatch.context() as patch:
        patch.setattr(race, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
        rate, decode_rate, cached_tokens = race.run_sluice(llm, prompts, 5)
    seconds = time.perf_counter() - start
    assert cached_tokens == 0  # 8-token prompts: not a full block, nothing to serve from the cache
    assert rate == 3 * 5 / 2.5  # 3 requests x 5 tokens over the run's wall time
    # 3 x 4 tokens after the first ones, over less time than the whole run (the prefill is not in it)
    assert decode_rate is not None and decode_rate > 3 * 4 / seconds
    hf_rate = race.run_transformers(AutoModelForCausalLM.from_pretrained(llama_dir).eval(), prompts, 5)
    assert 0 < 1 / hf_rate < 60


def test_table_prints_ratios_against_sluice(capsys):
    rows = [
        race.Row("sluice fp32", 1, 30.0),
        race.Row("transformers static batch", 1, 15.0),
        race.Row("sluice fp32", 16, 200.0),
        race.Row("transformers static batch", 16, 80.0),
        race.Row("llama.cpp (Q4_1 GGUF)", 1, None, "llama.cpp run failed"),
    ]
    race.print_table(rows, [1, 16])
    printed = capsys.readouterr().out
    ratio_line = next(line for line in printed.splitlines() if "/ transformers" in line)
    assert ratio_line.split()[-2:] == ["2.00x", "2.50x"]
    assert "note: llama.cpp (Q4_1 GGUF) at 1: llama.cpp run failed" in printed


def test_missing_llama_cpp_python_is_a_reason_not_an_error():
    assert "no --llamacpp-python given" in race.llamacpp_unavailable_reason(None)
    reason = race.llamacpp_unavailable_reason(sys.executable)  # the project's venv has no llama_cpp
    assert reason is not None and "cannot import llama_cpp" in reason


def test_machine_limits_are_measured():
    assert limits.read_bandwidth_gbs(megabytes=16, repeats=1) > 0.1
    gemm = limits.gemm_gflops(size=256, repeats=2)
    assert list(gemm)[1] == "torch" and list(gemm)[0].startswith("numpy (")
    assert all(rate > 0.1 for rate in gemm.values())


def test_linear_flops_count_every_computed_token_and_every_sampled_row(llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_dir)
    layer_weights = sum(m.weight.numel() for m in hf.model.layers.modules() if isinstance(m, torch.nn.Linear))
    model = LLM(llama_dir, dtype="float32", num_blocks=16).engine.model_runner.model
    # 10 prompt tokens and 4 outputs: 13 tokens through the layers, 4 rows through lm_head
    expected = 2 * (layer_weights * 13 + hf.lm_head.weight.numel() * 4)
    assert limits.linear_flops_per_request(model, prompt_len=10, max_tokens=4) == expected


def test_the_floor_is_memory_bound_at_batch_1_and_compute_bound_above():
    # 1 GB of weights at 20 GB/s: 64 steps take 3.2 s; 10 GFLOP a request at 100 GFLOP/s: 0.1 s each
    roofline = limits.Roofline(20.0, 100.0, weight_bytes=10**9, flops_per_request=10**10, max_tokens=64)
    assert roofline.tokens_per_second(1) == pytest.approx(64 / 3.2)
    assert roofline.tokens_per_second(32) == pytest.approx(32 * 64 / 3.2)  # both 3.2 s
    assert roofline.tokens_per_second(64) == pytest.approx(64 * 64 / 6.4)
    assert roofline.why(1) == "memory: 1000 MB a step at 20.0 GB/s -> 20.0 tok/s"
    assert roofline.why(64) == "compute: 640 GFLOP at 100 GFLOP/s -> 640.0 tok/s"


def test_rounds_give_median_rates_and_the_median_of_each_rounds_own_ratio(capsys):
    rows = [
        race.Row("sluice fp32", 16, 200.0, round=0),
        race.Row("transformers static batch", 16, 80.0, round=0),  # 2.5x
        race.Row("sluice fp32", 16, 150.0, round=1),
        race.Row("transformers static batch", 16, 100.0, round=1),  # 1.5x
        race.Row("sluice fp32", 16, 240.0, round=2),
        race.Row("transformers static batch", 16, 200.0, round=2),  # 1.2x
    ]
    race.print_table(rows, [16])
    lines = capsys.readouterr().out.splitlines()
    assert next(line for line in lines if line.startswith("sluice fp32 ")).split()[-2:] == ["200.0", "tok/s"]
    assert next(line for line in lines if line.startswith("transformers")).split()[-2:] == ["100.0", "tok/s"]
    # the median of 2.5, 1.5 and 1.2, not the medians' ratio (200 / 100)
    ratio_line = next(line for line in lines if "/ transformers" in line)
    assert ratio_line.split()[-2:] == ["1.50x", "(1.20-2.50)"]


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        race.parse_args(["--rounds", "0"])
    assert "--rounds: must be >= 1, got 0" in capsys.readouterr().err


def test_a_two_round_race_runs_every_engine_each_round_in_turn_on_new_prompts(tmp_path, capsys, monkeypatch):
    computed = []  # (prompt tokens the engine computed, prompt tokens it was given), per Sluice run
    run_sluice = race.run_sluice

    def counting_run(llm, prompts, max_tokens):
        before = llm.engine.core.stats().num_prompt_tokens_computed
        result = run_sluice(llm, prompts, max_tokens)
        after = llm.engine.core.stats().num_prompt_tokens_computed
        computed.append((after - before, sum(len(p) for p in prompts)))
        return result

    monkeypatch.setattr(race, "run_sluice", counting_run)
    monkeypatch.setattr(race, "gemm_gflops", functools.partial(limits.gemm_gflops, size=256))
    out = tmp_path / "race.json"
    race.main(  # 40-token prompts fill 2 blocks of 16: a repeated prompt would be a prefix-cache hit
        ["--concurrency", "1", "2", "--prompt-len", "40", "--max-tokens", "3", "--rounds", "2"]
        + ["--quantization", "int4", "--skip-transformers", "--json", str(out)]
    )
    result = json.loads(out.read_text())
    runs = [(row["engine"], row["concurrency"], row["round"]) for row in result["rows"]]
    fp32, int4 = "sluice fp32", "sluice int4"
    first = [(fp32, 1, 0), (int4, 1, 0), (fp32, 2, 0), (int4, 2, 0)]
    second = [(int4, 1, 1), (fp32, 1, 1), (int4, 2, 1), (fp32, 2, 1)]  # the engines in reverse order
    assert runs == first + second
    assert all(row["tokens_per_second"] > 0 for row in result["rows"])
    assert [row["cached_tokens"] for row in result["rows"]] == [0] * 8  # as the engines' stats say below
    # each engine's warm-up, then eight race runs, each computing every prompt token: none from the cache
    assert computed == [(32, 32)] * 2 + [(40, 40), (40, 40), (80, 80), (80, 80)] * 2
    machine = result["machine"]
    floors = machine["floors"]  # one probe before each fp32 run
    assert [(f["round"], f["concurrency"]) for f in floors] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for f in floors:
        roofline = limits.Roofline(
            f["read_bandwidth_gbs"], max(f["gemm_gflops"].values()), machine["weight_bytes"],
            machine["linear_flops_per_request"], max_tokens=3,
        )  # fmt: skip
        assert f["floor"] == pytest.approx(roofline.tokens_per_second(f["concurrency"]))
        assert f["bound"] == roofline.bound(f["concurrency"])
    printed = capsys.readouterr().out
    rates = {
        (r["round"], r["concurrency"]): r["tokens_per_second"] for r in result["rows"] if r["engine"] == fp32
    }
    for c in (1, 2):
        assert printed.count(f"sluice fp32 at {c}: ") == 2
        shares = [rates[f["round"], c] / f["floor"] for f in floors if f["concurrency"] == c]
        listed = f"{statistics.median(shares):.0%} ({shares[0]:.0%}, {shares[1]:.0%})"
        assert f"sluice fp32 at {c}, of the floor probed before it: {listed}" in printed
    assert "llama.cpp: skipped: no --llamacpp-python given" in printed
    assert "warning" not in printed


def test_a_run_served_from_the_prefix_cache_is_warned_about(capsys):
    rows = [
        race.Row("sluice fp32", 16, 200.0, cached_tokens=0),
        race.Row("sluice fp32", 64, 300.0, cached_tokens=32),
    ]
    race.print_table(rows, [16, 64])
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert warnings == [
        "warning: sluice fp32 at 64, round 0: 32 prompt tokens served from the prefix cache, though its "
        "prompts are new: that run timed the cache"
    ]
