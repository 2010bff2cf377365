"""`sluice.benchmarks.gpu.fp8_linear_bench` in its CPU mode (the interpreter, a tiny shape): it runs end to
end, checks the fp8 outputs (per channel and in 128 x 128 blocks) against bf16's and writes its tables. Its
GPU figures come from the GPU check."""

from __future__ import annotations

import re

from sluice.benchmarks.gpu.fp8_linear_bench import LATENCY_SWEEP, SWEEP, _tile, linears, main


def test_the_cpu_mode_writes_both_tables(tmp_path):
    out = tmp_path / "fp8_linears.md"
    assert main([str(out), "--device", "cpu", "--cap-s", "30"]) == 0
    report = out.read_text()
    rows = re.findall(
        r"^\| tiny one \| 32 x 256 \| (\d+) \|.*\| ([0-9.]+) \| ([0-9.]*) \| ([0-9.]*) \| ([0-9.]+) "
        r"\| ([0-9.e-]+) \| [0-9.]+ \| [0-9.]+ \|$",
        report,
        re.M,
    )
    # every row has its block 128, block gemv and block skinny times (the block linears' path at 1-64 rows),
    # and the bf16 skinny launch's time and ratio
    assert [(m, bool(gemv), bool(skinny)) for m, _, gemv, skinny, *_ in rows] == [
        ("1", True, True),
        ("4", True, True),
    ]
    assert all(float(diff) < 0.1 for *_, diff in rows)  # fp8 rounding of the weight and x, nothing worse
    # at 4 rows the skinny launch splits K in two: timed with its reduce launch and with the reduce fused
    skinny = r"^\| tiny one \| 32 x 256 \| 4 \| [0-9.]+ \|  \| [0-9.]+ \| [^|]* \| ([0-9.]+) \| ([0-9.]+) \|"
    assert len(re.findall(skinny, report, re.M)) == 1
    # per layer: bf16, fp8 as served, best fp8, their ratios, the block linears as served, bf16 skinny
    layer = r"^\| tiny \| (\d) \|" + r" [0-9.]+ \|" * 9 + "$"
    assert re.findall(layer, report, re.M) == ["1", "4"]


def test_the_linears_of_a_preset_are_its_four_projections():
    shapes = {(lin.name, lin.out_features, lin.in_features) for lin in linears("llama-3-8b")}
    assert shapes == {("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)}


def test_the_one_row_sweep_tries_the_latency_options_first_and_names_them():
    assert SWEEP[: len(LATENCY_SWEEP)] == LATENCY_SWEEP and len(set(SWEEP)) == len(SWEEP)
    assert {c.split_k for c in LATENCY_SWEEP} == {1, 2, 4, 8}
    assert any(c.prefetch for c in LATENCY_SWEEP) and any(c.amax_k for c in LATENCY_SWEEP)
    assert any(c.stages > 1 for c in LATENCY_SWEEP)
    plain = {(c.prefetch, c.split_k, c.amax_k, c.stages) for c in SWEEP[len(LATENCY_SWEEP) :]}
    assert plain == {(False, 1, 0, 1)}
    labels = [_tile(c) for c in LATENCY_SWEEP]
    assert "16x512, 4 warps, amax 4096, stages 3" in labels
    assert "16x512, 4 warps, prefetch, split 4, amax 4096" in labels
    assert "16x1024, 8 warps, prefetch" in labels
