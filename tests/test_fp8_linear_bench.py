"""`sluice.benchmarks.gpu.fp8_linear_bench` in its CPU mode (the interpreter, a tiny shape): it runs end to
end, checks the fp8 outputs (per channel and in 128 x 128 blocks) against bf16's and writes its tables. Its
GPU figures come from the GPU check."""

from __future__ import annotations

import re

import pytest
import torch
from paged_batch import DEVICE

from sluice.benchmarks.gpu import fp8_linear_bench
from sluice.benchmarks.gpu.fp8_linear_bench import (
    LATENCY_SWEEP,
    SKINNY_SWEEP,
    SWEEP,
    WIDE_SKINNY_SWEEP,
    Linear,
    _tile,
    linears,
    main,
    run,
    skinny_candidates,
)
from sluice.engine.worker.layers.fp8_linear import quantize_weight
from sluice.kernels.fp8_quant import quantize_fp8
from sluice.kernels.fp8_skinny_mm import fp8_skinny_mm


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


def test_a_run_cut_short_keeps_the_linears_it_finished(monkeypatch):
    """The GPU check's step limit may kill the bench: the report is handed on after each linear, so the
    file holds what was timed, and says it is partial."""
    bench = fp8_linear_bench.bench_linear

    def bench_then_die(linear, *args):
        if linear.name == "two":
            raise KeyboardInterrupt  # the step's timeout, as far as the file can tell
        return bench(linear, *args)

    monkeypatch.setattr(fp8_linear_bench, "bench_linear", bench_then_die)
    written = []
    shapes = [Linear("tiny", "one", 32, 256), Linear("tiny", "two", 64, 256)]
    with pytest.raises(KeyboardInterrupt):
        run(torch.device("cpu"), 0.0, shapes=shapes, written=written.append)
    (report,) = written
    assert "Partial: 1 of 2 linears timed so far." in report
    assert re.search(r"^\| tiny one \| 32 x 256 \| 1 \|", report, re.M) and "tiny two" not in report


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


def test_from_32_rows_the_skinny_sweep_tries_wider_channel_blocks_first_and_each_computes_the_product():
    assert skinny_candidates(16) == SKINNY_SWEEP
    assert skinny_candidates(64) == WIDE_SKINNY_SWEEP + SKINNY_SWEEP
    assert {(c.block_n, c.num_warps) for c in WIDE_SKINNY_SWEEP} == {(128, 8), (256, 8)}
    assert not set(WIDE_SKINNY_SWEEP) & set(SKINNY_SWEEP)
    # 64 rows, N of 300 (a partial channel block at 128 and at 256), K of 640 in 1-8 splits of 128 columns
    gen = torch.Generator().manual_seed(5)
    x_q, x_scale = quantize_fp8((torch.randn(64, 640, generator=gen) * 3).to(DEVICE))
    weight, weight_scale = quantize_weight(torch.randn(300, 640, generator=gen) * 0.05)
    weight, weight_scale = weight.to(DEVICE), weight_scale.to(DEVICE)
    want = (x_q.float() @ weight.float().t()) * x_scale.float() * weight_scale
    for config in WIDE_SKINNY_SWEEP:
        got = fp8_skinny_mm(x_q, x_scale, weight, weight_scale, torch.float32, config)
        # the same exact products, summed in another order (on a GPU the MMA adds a K tile in less than fp32)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
