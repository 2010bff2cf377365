"""Programmatic dependent launch (`sluice.kernels.dependent_launch`): when the launchers use it, and how much
of their weights the FP8 linears ask L2 for before their wait. What the GPU compiles of it (every kernel
waits before touching activations) is checked in test_kernels_compile.py, what it computes on a GPU by the
GPU check's `pdl` section (the graph step's logits equal with and without it)."""

from __future__ import annotations

import os

import paged_batch  # noqa: F401  (first: runs the kernels in the interpreter without CUDA)
import pytest
import torch

from sluice.benchmarks.gpu import dependent_launch_step, gpu_benchmarks
from sluice.benchmarks.gpu.dependent_launch_step import (
    NORM_APART,
    NORM_FOLDED,
    SILU_APART,
    SILU_FOLDED,
    WITH_PDL,
    WITHOUT_PDL,
)
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.presets import PRESETS
from sluice.engine.worker.layers import fp8_linear
from sluice.kernels import dependent_launch, fp8_skinny_mm, skinny_mm
from sluice.kernels.dependent_launch import (
    L2_PREFETCH_BUDGET,
    MAX_PREFETCH_ROW_BYTES,
    PDL_ENV,
    pdl_launch_options,
    weight_prefetch_bytes,
)

CPU = torch.device("cpu")


def test_off_in_the_interpreter_and_with_the_switch_on_for_ahead_of_time_compiles(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dependent_launch.dependent_launch(CPU)
    assert pdl_launch_options(CPU) == {"PDL": False, "launch_pdl": False}
    monkeypatch.delenv("TRITON_INTERPRET")
    # scripts/compile_kernels.py's sm_90 compiles: as an H100/H200 launches
    assert dependent_launch.dependent_launch(CPU)
    assert pdl_launch_options(CPU) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(PDL_ENV, "0")
    assert not dependent_launch.dependent_launch(CPU)
    monkeypatch.setenv(PDL_ENV, "1")
    assert dependent_launch.dependent_launch(CPU)


@pytest.mark.parametrize(
    ("programs", "rows", "row_bytes", "expected"),
    [
        (96 * 4, 64, 1024, 512),  # llama-3-8b qkv at one row: 96 channel blocks, K split in 4
        (4096 // 8, 8, 4096, 4096),  # its o_proj on fp8_gemv (8 channels a program): all 16 MiB
        (28672 // 32, 32, 4096, 512),  # gate_up: 896 programs of 32 channels
        (64 * 4, 64, 3584, 1024),  # down_proj: 14,336 columns in 4 splits of 3,584
        (2, 16, 1 << 20, MAX_PREFETCH_ROW_BYTES),  # a small launch: capped a row
        (4, 16, 3000, 2048),  # a power of two, within the row's slice
        (1 << 16, 64, 4096, 0),  # not one line a row within the budget: none
        (8, 8, 100, 0),  # a slice narrower than a line
    ],
)
def test_prefetch_is_a_power_of_two_of_lines_within_the_launchs_l2_budget(
    monkeypatch, programs, rows, row_bytes, expected
):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(PDL_ENV, raising=False)
    assert weight_prefetch_bytes(CPU, programs, rows, row_bytes) == expected
    assert programs * rows * expected <= L2_PREFETCH_BUDGET
    monkeypatch.setenv(PDL_ENV, "0")  # without PDL the loads follow at once: nothing to prefetch
    assert weight_prefetch_bytes(CPU, programs, rows, row_bytes) == 0


def test_the_pdl_section_captures_one_graph_with_pdl_and_one_without_for_each_kind_of_linear(
    monkeypatch, scaled_mm_on_cpu
):
    """bench_dependent_launch on the tiny preset, with bf16 linears on cuBLAS's path and on the skinny
    launch, and with FP8 ones (quantized at load; on `_scaled_mm`, the GPU's matmul, and one-row steps on
    `fp8_skinny_mm` as the larger weights take it): every launch of each pair's first graph sees PDL
    allowed, every launch of the second SLUICE_PDL=0 (the interpreter launches without it either way), only
    the skinny model runs `skinny_mm` (SiLU-and-mul in down_proj's launch but in its third row, the one-row
    step's RMSNorms in the linears' launches but in its fourth), only the FP8 model's third row runs its
    norms in `fp8_normed_skinny_mm` and only its fourth its SiLU-and-mul in `fp8_gated_skinny_mm`, the
    logits of each model's rows are equal and the switch is put back."""
    monkeypatch.setattr(fp8_linear, "GEMV_MAX_WEIGHT", 0)
    # The tiny preset with 2 layers and a 4,096-token vocabulary: under the interpreter its 32,000-row
    # lm_head and 4 layers took ~3 minutes of ten graphs; what is checked does not depend on either.
    smaller = {**PRESETS["tiny"], "num_hidden_layers": 2, "vocab_size": 4096}
    monkeypatch.setattr(
        gpu_benchmarks, "preset_arch", lambda name: ModelArchConfig.from_hf_config(smaller, name)
    )
    seen, skinny, normed_fp8, gated_fp8 = [], [], [], []

    def spy(device: torch.device) -> bool:
        seen.append(os.environ.get(PDL_ENV))
        return False

    launch = skinny_mm.skinny_mm

    def skinny_spy(x: torch.Tensor, weight: torch.Tensor, gated: bool, norm) -> torch.Tensor:
        skinny.append((os.environ.get(PDL_ENV), gated, norm is not None))
        return launch(x, weight, gated=gated, norm=norm)

    normed_launch = fp8_skinny_mm.fp8_normed_skinny_mm

    def normed_spy(x: torch.Tensor, *args) -> torch.Tensor:
        normed_fp8.append(len(rows_timed))
        return normed_launch(x, *args)

    gated_launch = fp8_skinny_mm.fp8_gated_skinny_mm

    def gated_spy(gate_up: torch.Tensor, *args) -> torch.Tensor:
        gated_fp8.append(len(rows_timed))
        return gated_launch(gate_up, *args)

    monkeypatch.setattr(fp8_skinny_mm, "fp8_gated_skinny_mm", gated_spy)
    monkeypatch.setattr(dependent_launch, "dependent_launch", spy)
    monkeypatch.setattr(skinny_mm, "skinny_mm", skinny_spy)
    monkeypatch.setattr(fp8_skinny_mm, "fp8_normed_skinny_mm", normed_spy)
    monkeypatch.delenv(PDL_ENV, raising=False)
    times = iter([0.002, 0.003, 0.004, 0.005, 0.0045, 0.0042, 0.006, 0.007, 0.0055, 0.0058])
    rows_timed = []  # a graph's timing, as each is taken

    def time_s(fn) -> float:
        fn()
        rows_timed.append(next(times))
        return rows_timed[-1]

    rows = dependent_launch_step.bench_dependent_launch(CPU, preset="tiny", context=40, time_s=time_s)
    runs = [value for index, value in enumerate(seen) if index == 0 or seen[index - 1] != value]
    assert runs == ["1", "0"] * 3 + ["1"]
    # the FP8 model's third graph only (8 graphs timed before it), captured and timed
    assert normed_fp8 and set(normed_fp8) <= {8, 9} and 8 in normed_fp8
    assert gated_fp8 and set(gated_fp8) <= {9, 10} and 9 in gated_fp8  # its fourth
    # the tiny preset's one-row steps, four graphs: (PDL, gated rows, normed rows) of each launch. Both folds
    # with and without PDL; then SiLU-and-mul apart (norms still folded), then the norms apart (SiLU folded).
    without = [index for index, kind in enumerate(skinny) if kind[0] == "0"]
    first, between, after = (
        skinny[: without[0]],
        skinny[without[0] : without[-1] + 1],
        skinny[without[-1] + 1 :],
    )
    for graph in (first, between):
        assert ("1" if graph is first else "0", True, False) in graph and any(kind[2] for kind in graph)
    assert all(kind[0] == "1" for kind in first + after) and all(kind[0] == "0" for kind in between)
    last_normed = max(index for index, kind in enumerate(after) if kind[2])
    first_gated = min(index for index, kind in enumerate(after) if kind[1])
    assert last_normed < first_gated  # the SiLU-apart graph's launches, then the norm-apart graph's
    assert not any(gated and normed for _, gated, normed in skinny)
    assert [row[:4] for row in rows] == [
        ["bf16", WITH_PDL, 2.0, 1.0],
        ["bf16", WITHOUT_PDL, 3.0, 1.5],
        ["bf16 skinny", WITH_PDL, 4.0, 1.0],
        ["bf16 skinny", WITHOUT_PDL, 5.0, 1.25],
        ["bf16 skinny", SILU_APART, 4.5, 1.125],
        ["bf16 skinny", NORM_APART, 4.2, 0.0042 / 0.004],
        ["fp8", WITH_PDL, 6.0, 1.0],
        ["fp8", WITHOUT_PDL, 7.0, 7 / 6],
        ["fp8", NORM_FOLDED, 5.5, 5.5 / 6],
        ["fp8", SILU_FOLDED, 5.8, 0.0058 / 0.006],
    ]
    assert [row[4] for row in rows] == [0.0] * 10  # on the CPU the norm's row sum is the same sum either way
    assert PDL_ENV not in os.environ
    figures = dependent_launch_step.dependent_launch_figures(rows)
    assert figures["bf16_skinny_norm_apart_step_s"] == pytest.approx(0.0042) and len(figures) == 10
    assert figures["fp8_norm_folded_step_s"] == pytest.approx(0.0055)
    assert figures["fp8_silu_folded_step_s"] == pytest.approx(0.0058)
    assert not any(dependent_launch_step.logits_depart(row) for row in rows)
    assert dependent_launch_step.logits_depart(["bf16 skinny", SILU_APART, 4.5, 1.125, 1e-7])
    assert not dependent_launch_step.logits_depart(["bf16 skinny", NORM_APART, 4.2, 1.05, 1e-3])
    assert dependent_launch_step.logits_depart(["fp8", SILU_FOLDED, 5.8, 5.8 / 6, 1e-7])
