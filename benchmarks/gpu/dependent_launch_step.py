"""The batch-1 CUDA-graph decode step with programmatic dependent launch (`sluice.kernels.dependent_launch`,
the default on sm_90+) and without it (SLUICE_PDL=0), each pair on one model in one process, with bf16
linears on cuBLAS, bf16 linears on Sluice's skinny launch (`skinny_linears`: `sluice.kernels.skinny_mm`,
which asks L2 for its weights before its wait) and FP8 ones: the GPU check's `pdl` section. PDL changes
when kernels start, never what they compute, so a pair's logits must be equal bit for bit; a difference
means a kernel read something before its wait. The first two pairs' "with" rows are also cuBLAS against
Sluice's linears in the same step (issue 33's 1b batch-1 step: docs/GPU.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from sluice.benchmarks.gpu.gpu_benchmarks import BENCH_CONTEXT, time_batch1_graph_steps, time_cuda_s
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
        variants = [(select, context, {PDL_ENV: "1"}), (select, context, {PDL_ENV: "0"})]
        _, ((with_s, _), (without_s, difference)) = time_batch1_graph_steps(
            device, preset, context, variants, time_s, fp8
        )
        rows.append([linears, "with PDL (default on sm_90+)", with_s * 1e3, 1.0, 0.0])
        rows.append([linears, f"without ({PDL_ENV}=0)", without_s * 1e3, without_s / with_s, difference])
    return rows


def _default_linears(kernels: KernelConfig) -> KernelConfig:
    return kernels


def _skinny_linears(kernels: KernelConfig) -> KernelConfig:
    return dataclasses.replace(kernels, skinny_linears=True)
