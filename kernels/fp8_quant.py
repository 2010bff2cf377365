"""Quantize a linear layer's input to e4m3 in one launch: the FP8 linears' activations on `torch._scaled_mm`.

    dynamic (per token):  scale[m] = max(max_k |x[m, k]| / 448, float32 tiny)     written [M, 1] float32
                          with a cap (`scale_ub`, FBGEMM's): min(max_k |x[m, k]|, scale_ub) / 448
    static:               scale[m] = input_scale                                  (read on the device)
    x_q[m, k] = e4m3(clamp(x[m, k] / scale[m], -448, 448))                        written [M, K] e4m3

Bit for bit `sluice.engine.worker.layers.fp8_linear.quantize_activations(x, "token")` (and `"static"`),
its plain PyTorch version (the emulated CPU path's, kept there): amax in fp32 (exact; `amax_keep_nan`), both
divisions IEEE-exact (`div_rn`), the codes made by `store_kv.quantize_e4m3` (round to nearest even,
saturated: the GPU's conversion on sm_89+, integer arithmetic in the interpreter) into the e4m3 tensor
viewed as uint8. That is the function run on CPU: torch on CUDA divides
amax by the Python scalar 448 as a product with its reciprocal, which can miss the quotient by an ulp. On an
H100 (2026-11-26) the kernel's codes and scales equalled the CPU function's in every case of
tests/test_kernels_fp8_quant.py.
A NaN in a row makes its scale and all its codes NaN, as torch's amax does. The scale is written [M, 1]
contiguous, the row-wise `_scaled_mm`'s scale_a as it is; a static launch writes input_scale in each row.
Nothing is read back to the host: a captured CUDA graph replays it. One fused launch replaces the ~10
ATen kernels of the torch version.

Grid (M,): one program per row. A row of up to MAX_TILE columns is one tile, loaded once and kept in
registers; a wider one (an MLP's intermediate size) is read twice in MAX_TILE-wide tiles, amax then codes
(its first tile stays in registers).
num_warps grows with the tile (`warps_for_columns`: one warp per 256 columns, 1 to 16; untuned).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.compile_target import warps_for_columns
from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.store_kv import gpu_e4m3, quantize_e4m3
from sluice.kernels.tensor_checks import (
    FLOAT_DTYPES,
    check_power_of_two,
    check_same_dtype,
    check_tensor,
    checked_output,
)

FP8 = torch.float8_e4m3fn
MAX_TILE = 4096  # columns a program holds at once


@triton.jit
def max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def amax_keep_nan(magnitudes, axis: tl.constexpr):
    """The max of |x| values (fp32, nonnegative or NaN) over `axis`, NaN where any is NaN, as a reduction
    with `max_keep_nan` gives it, in one builtin integer reduction: with the sign bit cleared, fp32 bit
    patterns order as their magnitudes do, every NaN's above +inf's. `tl.max` on the floats skips NaN on a
    GPU, `tl.reduce` with a jit combine runs element by element in Python under the interpreter (seconds
    for a few wide rows), and the float max and sum this took before were two reductions where one integer
    max is a warp instruction on sm_80+ (`redux.sync`)."""
    bits = magnitudes.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(bits, axis).to(tl.float32, bitcast=True)


@triton.jit
def capped(amax, scale_ub, CAPPED: tl.constexpr):
    """amax, or with CAPPED min(amax, scale_ub) (fbgemm_fp8's cap on a row's amax; NaN kept): the values
    past the cap then saturate at +-448."""
    if CAPPED:
        amax = tl.minimum(amax, scale_ub, propagate_nan=tl.PropagateNan.ALL)
    return amax


@triton.jit
def dynamic_scale(amax):
    """amax / 448, IEEE-rounded, at least float32's tiny (an all-zero row gets zero codes, not NaN)."""
    return max_keep_nan(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)


@triton.jit
def _fp8_quant_kernel(
    out_ptr,  # [M, K] uint8: the e4m3 codes
    scale_ptr,  # [M, 1] float32: written
    x_ptr,  # [M, K] bf16/fp16/fp32
    input_scale_ptr,  # static only: [] or [1] float32, read
    scale_ub,  # CAPPED only: the cap on each row's amax (float32)
    stride_x,
    stride_out,
    stride_scale,
    K: tl.constexpr,
    TILE: tl.constexpr,
    DYNAMIC: tl.constexpr,
    CAPPED: tl.constexpr,
    HW_E4M3: tl.constexpr,
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    wait_prior_kernel(PDL)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    cols = tl.arange(0, TILE)
    first = tl.load(x_row + cols, mask=cols < K, other=0.0)  # with K <= TILE the whole row, kept
    if DYNAMIC:
        running = tl.abs(first.to(tl.float32))
        for start in range(TILE, K, TILE):  # rows wider than a tile: first pass, amax
            x = tl.load(x_row + start + cols, mask=start + cols < K, other=0.0)
            running = max_keep_nan(running, tl.abs(x.to(tl.float32)))
        scale = dynamic_scale(capped(amax_keep_nan(running, 0), scale_ub, CAPPED))
    else:
        scale = tl.load(input_scale_ptr)
    tl.store(out_row + cols, quantize_e4m3(first, scale, HW_E4M3), mask=cols < K)
    for start in range(TILE, K, TILE):  # second pass: the codes of the other tiles
        mask = start + cols < K
        x = tl.load(x_row + start + cols, mask=mask, other=0.0)
        tl.store(out_row + start + cols, quantize_e4m3(x, scale, HW_E4M3), mask=mask)
    tl.store(scale_ptr + row * stride_scale, scale)


def quantize_fp8_per_token(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    scale_ub: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, unit last stride, any row stride) -> (x_q [M, K] float8_e4m3fn, scale [M, 1]
    float32), x ~ x_q * scale with one scale per row (max |x[m]| / 448; with `scale_ub`, a positive finite
    cap, min(max |x[m]|, scale_ub) / 448). Written into `out` / `scale_out` when given. Raises ValueError
    naming a bad argument."""
    return _launch(x, None, out, scale_out, scale_ub)


def quantize_fp8_static(
    x: torch.Tensor,
    input_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] float8_e4m3fn of x / input_scale, saturated at +-448; scale [M, 1] float32,
    input_scale in each row, as the row-wise `_scaled_mm` takes it). input_scale: [] or [1] float32 on x's
    device, read by the kernel (no host sync). Raises ValueError naming a bad argument."""
    if input_scale is None:
        raise ValueError("input_scale: expected a torch.Tensor, got NoneType")
    return _launch(x, input_scale, out, scale_out)


def check_input_scale(input_scale: torch.Tensor, device: torch.device) -> None:
    """Raise ValueError unless `input_scale` is a [] or [1] float32 tensor on `device`."""
    if not isinstance(input_scale, torch.Tensor):
        raise ValueError(f"input_scale: expected a torch.Tensor, got {type(input_scale).__name__}")
    if input_scale.dim() > 1 or input_scale.numel() != 1:
        raise ValueError(f"input_scale: expected shape () or (1,), got {tuple(input_scale.shape)}")
    check_same_dtype("input_scale", input_scale, torch.float32)
    if input_scale.device != device:
        raise ValueError(f"input_scale: on {input_scale.device}, expected {device}")


def check_scale_ub(scale_ub: float | None) -> None:
    """Raise ValueError unless `scale_ub` (a cap on each row's amax) is None or a positive finite float."""
    if scale_ub is not None and not (isinstance(scale_ub, float) and 0 < scale_ub < float("inf")):
        raise ValueError(f"scale_ub: must be a positive finite float, got {scale_ub!r}")


def check_quantization(
    input_scale: torch.Tensor | None,
    group_size: int | None,
    device: torch.device,
    scale_ub: float | None = None,
) -> None:
    """Raise ValueError unless the fused kernels' quantization is one they make: per token (neither; with
    a `scale_ub` cap or not), a static `input_scale` (`check_input_scale`), or dynamic per group of
    `group_size` columns (a power of two >= 16, as `quantize_fp8_groups` takes), one at a time."""
    check_scale_ub(scale_ub)
    if scale_ub is not None and (input_scale is not None or group_size is not None):
        raise ValueError("scale_ub: caps per-token scales, not with an input_scale or a group_size")
    if group_size is not None:
        if input_scale is not None:
            raise ValueError(
                "input_scale: group scales are dynamic, got a static input_scale with group_size"
            )
        check_power_of_two("group_size", group_size, 16)
    elif input_scale is not None:
        check_input_scale(input_scale, device)


def quantized_outputs(
    out: torch.Tensor | None,
    scale_out: torch.Tensor | None,
    num_rows: int,
    width: int,
    device: torch.device,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [num_rows, width] e4m3, scale [num_rows, 1] float32, or [num_rows, cdiv(width, group_size)]
    with a group_size): `out` / `scale_out` checked, or new."""
    scales = 1 if group_size is None else -(-width // group_size)
    return (
        checked_output("out", out, (num_rows, width), FP8, device),
        checked_output("scale_out", scale_out, (num_rows, scales), torch.float32, device),
    )


def quantize_fp8(
    x: torch.Tensor, input_scale: torch.Tensor | None = None, scale_ub: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_static(x, input_scale)` when a static input_scale is given, else
    `quantize_fp8_per_token(x, scale_ub=scale_ub)`: the FP8 linears' one call."""
    if input_scale is None:
        return quantize_fp8_per_token(x, scale_ub=scale_ub)
    if scale_ub is not None:
        raise ValueError("scale_ub: caps dynamic scales, got a static input_scale too")
    return quantize_fp8_static(x, input_scale)


def _launch(
    x: torch.Tensor,
    input_scale: torch.Tensor | None,
    out: torch.Tensor | None,
    scale_out: torch.Tensor | None,
    scale_ub: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(x, input_scale)
    check_scale_ub(scale_ub)
    num_rows, width = x.shape
    out, scale_out = quantized_outputs(out, scale_out, num_rows, width, x.device)
    if num_rows == 0:
        return out, scale_out
    tile = min(triton.next_power_of_2(width), MAX_TILE)
    _fp8_quant_kernel[(num_rows,)](
        out.view(torch.uint8),
        scale_out,
        x,
        input_scale,
        scale_ub or 1.0,
        x.stride(0),
        out.stride(0),
        scale_out.stride(0),
        K=width,
        TILE=tile,
        DYNAMIC=input_scale is None,
        CAPPED=scale_ub is not None,
        HW_E4M3=gpu_e4m3(x.device),
        num_warps=warps_for_columns(tile, 16),
        **pdl_launch_options(x.device),
    )
    return out, scale_out


def _check_args(x: torch.Tensor, input_scale: torch.Tensor | None) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] == 0:
        raise ValueError(f"x: rows must not be empty, got shape {tuple(x.shape)}")
    if input_scale is not None:
        check_input_scale(input_scale, x.device)
