"""The batch-1 CUDA-graph decode step with programmatic dependent launch (`sluice.kernels.dependent_launch`,
the default on sm_90+) and without it (SLUICE_PDL=0), each pair on one model in one process, with bf16
linears on cuBLAS, bf16 linears on Sluice's skinny launch (`skinny_linears`: `sluice.kernels.skinny_mm`,
which asks L2 for its weights before its wait) and FP8 ones: the GPU check's `pdl` section. PDL changes
when kernels start, never what they compute, so a pair's logits must be equal bit for bit; a difference
means a kernel read something before its wait. The first two pairs' "with" rows are also cuBLAS against
Sluice's linears in the same step (issue 33's 1b batch-1 step: docs/GPU.md). The skinny model runs
SiLU-and-mul inside down_proj's launch (`fuse_silu_skinny`) and the RMSNorms inside qkv_proj's and
gate_up_proj's (`fuse_norm_skinny`); one more row of it runs SiLU-and-mul in its own launch, the same bits
(the gated loads are `silu_and_mul`'s jit helper), so its logits must equal the pair's too; another the
norms in theirs, whose logits may differ by the rounding of a row's sum of squares reduced over another
layout (`logits_depart`). And one more row of the FP8 model runs the norms before its one-row linears
inside their launches (`fuse_norm_fp8`, off by default: on this preset qkv_proj's `fp8_normed_gemv` and
gate_up_proj's `fp8_normed_skinny_mm`, 32 launches a step fewer), within the same tolerance; another
SiLU-and-mul inside down_proj's (`fuse_silu_fp8`, off by default: `fp8_gated_gemv` on this preset, 16
launches fewer), the same bits as the first row (the same jit helpers; a row's amax in any order)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from sluice.benchmarks.gpu.gpu_benchmarks import (
    BENCH_CONTEXT,
    GRAPH_MAX_REL_DIFF,
    time_batch1_graph_steps,
    time_cuda_s,
)
from sluice.engine.loading.fp8_config import QUANTIZE_AT_LOAD
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.kernels.dependent_launch import PDL_ENV


def bench_dependent_launch(
    device: torch.device,
    preset: str = "llama-3.2-1b",
    context: int = BENCH_CONTEXT,
    time_s: Callable[[Callable[[], object]], float] = time_cuda_s,
) -> list[list[object]]:
    """Rows (linears, launches, graph step ms, time vs with PDL, logits vs with PDL (max rel diff)) of
    `preset`'s batch-1 graph step (random bf16 weights) at a `context`-token context, with its linears in
    bf16 (cuBLAS), in bf16 on `skinny_mm` ("bf16 skinny") and quantized to FP8 at load (`--quantization
    fp8`: `fp8_gemv` and `fp8_skinny_mm`); the skinny launches prefetch their weights before the wait."""
    rows = []
    for linears, fp8 in (("bf16", None), ("bf16 skinny", None), ("fp8", QUANTIZE_AT_LOAD)):
        select = _skinny_linears if linears == "bf16 skinny" else _default_linears
        labeled = [(WITH_PDL, select, "1"), (WITHOUT_PDL, select, "0")]  # the first: every row's baseline
        if linears == "bf16 skinny":
            labeled += [(SILU_APART, _silu_apart, "1"), (NORM_APART, _norm_apart, "1")]
        if fp8 is not None:
            labeled += [(NORM_FOLDED, _fp8_norm_folded, "1"), (SILU_FOLDED, _fp8_silu_folded, "1")]
        variants = [(kernels, context, {PDL_ENV: pdl}) for _, kernels, pdl in labeled]
        _, timings = time_batch1_graph_steps(device, preset, context, variants, time_s, fp8)
        with_s = timings[0][0]
        for (label, *_), (seconds, difference) in zip(labeled, timings, strict=True):
            rows.append([linears, label, seconds * 1e3, seconds / with_s, difference])
    return rows


WITH_PDL = "with PDL (default on sm_90+)"
WITHOUT_PDL = f"without ({PDL_ENV}=0)"
SILU_APART = "with PDL, SiLU-and-mul in its own launch"
NORM_APART = "with PDL, RMSNorm in its own launch"
NORM_FOLDED = "with PDL, RMSNorm in the FP8 linear's launch"
SILU_FOLDED = "with PDL, SiLU-and-mul in the FP8 linear's launch"
_FIGURE_SUFFIXES = {
    WITH_PDL: "with_pdl",
    WITHOUT_PDL: "without_pdl",
    SILU_APART: "silu_apart",
    NORM_APART: "norm_apart",
    NORM_FOLDED: "norm_folded",
    SILU_FOLDED: "silu_folded",
}


def logits_depart(row: list[object]) -> bool:
    """Whether a row's logits are further from its model's first row than they may be: the same bits,
    but where the norms moved between launches (within GRAPH_MAX_REL_DIFF, as the other graph
    comparisons)."""
    return row[4] > (GRAPH_MAX_REL_DIFF if row[1] in (NORM_APART, NORM_FOLDED) else 0.0)


def dependent_launch_figures(rows: list[list[object]]) -> dict[str, float]:
    """The results file's figures of `bench_dependent_launch`'s rows: "<linears>_<variant>_step_s"."""
    return {
        f"{str(row[0]).replace(' ', '_')}_{_FIGURE_SUFFIXES[row[1]]}_step_s": row[2] / 1e3 for row in rows
    }


def _default_linears(kernels: KernelConfig) -> KernelConfig:
    return kernels


def _skinny_linears(kernels: KernelConfig) -> KernelConfig:
    return dataclasses.replace(kernels, skinny_linears=True)


def _silu_apart(kernels: KernelConfig) -> KernelConfig:
    return dataclasses.replace(kernels, skinny_linears=True, fuse_silu_skinny=False)


def _norm_apart(kernels: KernelConfig) -> KernelConfig:
    return dataclasses.replace(kernels, skinny_linears=True, fuse_norm_skinny=False)


def _fp8_norm_folded(kernels: KernelConfig) -> KernelConfig:
    return dataclasses.replace(kernels, fuse_norm_fp8=True)


def _fp8_silu_folded(kernels: KernelConfig) -> KernelConfig:
    return dataclasses.replace(kernels, fuse_silu_fp8=True)
