"""An FP8 linear's input quantized by the kernel that produced it (RMSNorm, SiLU-and-mul) instead of by the
linear's own `fp8_quant` launch: one launch fewer per such linear and step.

    scheme = linear.quantized_input(num_rows)       # Fp8InputScheme, or None: hand it the float x
    x_q, x_scale, residual = rms_norm_fp8_quant(x, weight, eps, residual, scheme.input_scale)
    y = linear(Fp8Activations(x_q, x_scale, x.dtype))

A linear answers a scheme only where it would run a quantization launch on x itself
(`Fp8LinearMethod.quantized_input`): an FP8 layer on `torch._scaled_mm` with per-token or static activations
(`fp8_quant`) in a step it does not run on `fp8_gemv` (which quantizes inside the product), or a block-FP8
layer on `block_triton` (`quantize_fp8_groups`: the scheme's `group_size`) in every step. Every other
linear (bf16, int8/int4, the emulated FP8 paths, the C++ CPU kernels) answers None and is handed the float
tensor as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8InputScheme:
    """How an FP8 linear quantizes its input: e4m3 with one dynamic scale per token (input_scale None), or
    with its static input_scale ([] float32 on the model's device, read by the kernel), or with a dynamic
    scale per token and group of `group_size` columns (block FP8; input_scale None). `scale_ub`: the
    per-token amax capped there first (fbgemm_fp8), else None."""

    input_scale: torch.Tensor | None = None
    group_size: int | None = None
    scale_ub: float | None = None


@dataclass(frozen=True)
class Fp8Activations:
    """x [M, in] already quantized as the consuming linear's `Fp8InputScheme` says: bit for bit what its own
    `fp8_quant` launch would write. Built on the hot path by the fused kernels' callers: not re-checked."""

    x_q: torch.Tensor  # [M, in] float8_e4m3fn
    x_scale: torch.Tensor  # [M, 1] float32; [M, cdiv(in, group_size)] for a group scheme
    dtype: torch.dtype  # x's dtype (the model's): the linear's output dtype
