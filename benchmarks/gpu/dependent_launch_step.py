"""The batch-1 CUDA-graph decode step with programmatic dependent launch (`sluice.kernels.dependent_launch`,
the default on sm_90+) and without it (SLUICE_PDL=0), each pair on one model in one process, with bf16
linears and with FP8 ones: the GPU check's `pdl` section. PDL changes when kernels start, never what they
compute, so a pair's logits must be equal bit for bit; a difference means a kernel read something before
its wait."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sluice.benchmarks.gpu.gpu_benchmarks import BENCH_CONTEXT, time_batch1_graph_steps, time_cuda_s
from sluice.engine.loading.fp8_config import QUANTIZE_AT_LOAD
from sluice.kernels.dependent_launch import PDL_ENV


def bench_dependent_launch(
    device: torch.device,
    preset: str = "llama-3.2-1b",
    context: int = BENCH_CONTEXT,
    time_s: Callable[[Callable[[], object]], float] = time_cuda_s,
) -> list[list[object]]:
    """Rows (linears, launches, graph step ms, time vs with PDL, logits vs with PDL (max rel diff)) of
    `preset`'s batch-1 graph step (random bf16 weights) at a `context`-token context, with its linears in
    bf16 (cuBLAS) and quantized to FP8 at load (`--quantization fp8`: `fp8_gemv` and `fp8_skinny_mm`, which
    also prefetch their weights before the wait)."""
    variants = [
        (lambda kernels: kernels, context, {PDL_ENV: "1"}),
        (lambda kernels: kernels, context, {PDL_ENV: "0"}),
    ]
    rows = []
    for linears, fp8 in (("bf16", None), ("fp8", QUANTIZE_AT_LOAD)):
        _, ((with_s, _), (without_s, difference)) = time_batch1_graph_steps(
            device, preset, context, variants, time_s, fp8
        )
        rows.append([linears, "with PDL (default on sm_90+)", with_s * 1e3, 1.0, 0.0])
        rows.append([linears, f"without ({PDL_ENV}=0)", without_s * 1e3, without_s / with_s, difference])
    return rows
