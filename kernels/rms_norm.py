"""Fused RMSNorm with an optional residual add, rounded like `transformers`' LlamaRMSNorm.

with residual:  residual_out = (x + residual) in x's dtype;  out = norm(residual_out)
without:        residual_out = x;                            out = norm(x)
norm(h) = weight * (h_fp32 * rsqrt(mean(h_fp32^2) + eps)).to(dtype)

`rms_norm_fp8_quant` runs the same kernel but writes, instead of `out`, its e4m3 codes and per-row fp32
scale for an FP8 linear (dynamic per token, or a static input_scale): bit for bit `rms_norm` then
`sluice.kernels.fp8_quant.quantize_fp8` (`out` rounded to x's dtype first, then quantized by the same jit
helpers). The row is already in registers, so the amax is a reduction there: one launch instead of two.
With `group_size` (a block-FP8 linear's input: a dynamic scale per row and group of group_size columns)
it is bit for bit `rms_norm` then `sluice.kernels.fp8_block_mm.quantize_fp8_groups`: the row viewed as
[groups, group_size], one amax per group.

The linears that take a one-row step's input before its norm (`skinny_mm(norm=)`, `fp8_normed_skinny_mm`,
`fp8_normed_gemv`: `RowNorm`) make it with this kernel's formula from the jit helpers below
(`row_inv_rms`, `row_norm_fp8_scale`, `normed_tile`, `norm_rounded`), the same roundings.

Grid (num_tokens,): one program per row, num_warps by the row's padded width (`norm_warps`: Triton's
layer-norm tutorial's rule, one warp per 256 columns, 1 to 8). A decode step's row is one program on one
SM, whose time is the longest thread's chain of instructions: at llama-3-8b's 4096 columns with the
residual, sm_90 SASS, 296 instructions a thread at 4 warps (the default before 2026-12-01) and 192 at 8
in bf16; 1024 and 624 quantizing to FP8. Not timed yet. `warps=` launches another count, for the kernel
bench (`fused_quant_bench`): vLLM's fused add-RMSNorm FP8 kernel runs a row on 1,024 threads below 256
tokens and on 256 from there (more threads hide a few rows' latency, fewer let more rows share an SM). The
sum of squares is reduced over the program's threads, so on a GPU another warp count may round it
otherwise: `rms_norm_fp8_quant` is bit for bit `rms_norm` at the same warps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sluice.kernels.compile_target import warps_for_columns
from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.fp8_block_mm import store_quantized_groups
from sluice.kernels.fp8_quant import (
    amax_keep_nan,
    capped,
    check_quantization,
    dynamic_scale,
    quantized_outputs,
)
from sluice.kernels.store_kv import gpu_e4m3, quantize_e4m3
from sluice.kernels.tensor_checks import (
    FLOAT_DTYPES,
    check_power_of_two,
    check_same_dtype,
    check_shape,
    check_tensor,
    output_like,
)


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, hidden] x's dtype; QUANTIZE: the e4m3 codes, [T, hidden] uint8
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    scale_ptr,  # QUANTIZE only: [T, 1] float32 (GROUP_SIZE: [T, cdiv(HIDDEN, GROUP_SIZE)]), written
    input_scale_ptr,  # QUANTIZE and not DYNAMIC only: [] or [1] float32, read
    scale_ub,  # CAPPED only: the cap on the row's amax (float32)
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    stride_scale,
    HIDDEN: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,  # a power of two >= HIDDEN (and >= GROUP_SIZE)
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr = False,
    DYNAMIC: tl.constexpr = True,
    GROUP_SIZE: tl.constexpr = 0,  # QUANTIZE: 0 for a scale per row, else per row and group (dynamic)
    CAPPED: tl.constexpr = False,  # QUANTIZE, DYNAMIC, a scale per row: the amax capped at scale_ub
    HW_E4M3: tl.constexpr = False,  # QUANTIZE: the GPU's e4m3 conversion (`store_kv.gpu_e4m3`)
    PDL: tl.constexpr = False,  # `dependent_launch`: the weight is loaded before the wait
):
    row = tl.program_id(0)
    cols = tl.arange(0, HIDDEN_PAD)
    mask = cols < HIDDEN
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    wait_prior_kernel(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first, as the unfused model does.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    out = norm_rounded(x, inv_rms, weight)
    if QUANTIZE and GROUP_SIZE > 0:  # quantize_fp8_groups' recipe, a [groups, GROUP_SIZE] view of the row
        shape: tl.constexpr = (HIDDEN_PAD // GROUP_SIZE, GROUP_SIZE)
        groups = tl.arange(0, HIDDEN_PAD // GROUP_SIZE)
        padded = tl.reshape(tl.where(mask, out, 0.0), shape)  # padding lanes zeroed: never in an amax
        codes, scales = out_ptr + row * stride_out, scale_ptr + row * stride_scale
        num_groups = (HIDDEN + GROUP_SIZE - 1) // GROUP_SIZE
        padded_cols = tl.reshape(cols, shape)
        store_quantized_groups(codes, scales, padded, padded_cols, groups, HIDDEN, num_groups, HW_E4M3)
    elif QUANTIZE:  # fp8_quant's recipe on the rounded row (padding lanes zeroed: never in the amax)
        if DYNAMIC:
            amax = amax_keep_nan(tl.where(mask, tl.abs(out.to(tl.float32)), 0.0), 0)
            scale = dynamic_scale(capped(amax, scale_ub, CAPPED))
        else:
            scale = tl.load(input_scale_ptr)
        tl.store(out_ptr + row * stride_out + cols, quantize_e4m3(out, scale, HW_E4M3), mask=mask)
        tl.store(scale_ptr + row * stride_scale, scale)
    else:
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def norm_rounded(h, inv_rms, weight):
    """weight * (h * inv_rms) in h's dtype (h: x, + residual, rounded to x's dtype; weight in it too), with
    the two roundings of transformers' LlamaRMSNorm: this kernel's formula, and the linears' that normalize
    their input as they load it (`row_inv_rms`, `normed_tile`)."""
    dtype = h.dtype
    normed = (h.to(tl.float32) * inv_rms).to(dtype)
    return (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype)


class RowNorm(NamedTuple):
    """A linear's RMSNorm (with its residual add) made in the linear's own loads, `rms_norm`'s: the `norm=`
    of `sluice.kernels.skinny_mm.skinny_mm`, `sluice.kernels.fp8_skinny_mm.fp8_normed_skinny_mm` and
    `sluice.kernels.fp8_gemv.fp8_normed_gemv`."""

    weight: torch.Tensor  # [K], x's dtype
    eps: float
    residual: torch.Tensor | None  # [1, K]: x + residual is normalized and written to residual_out
    residual_out: torch.Tensor | None  # [1, K], with residual: written by one program


NORM_MAX_ROWS = 1  # each program of such a linear sums its row's squares itself: one sequence's decode step


@triton.jit
def row_inv_rms(
    x_ptr, residual_ptr, residual_out_ptr, cols, eps, program, K: tl.constexpr, HAS_RESIDUAL: tl.constexpr
):
    """(1 / sqrt(mean(h^2) + eps), h) of row 0, h = x (+ residual, rounded to x's dtype and written to
    residual_out by the program numbered 0) in x's dtype, 0 past K: `rms_norm`'s formula over the whole row
    at once, for a linear's program that normalizes its input tiles (`normed_tile`)."""
    mask = cols < K
    h = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + cols, h, mask=mask & (cols * 0 + program == 0))
    squares = h.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(squares * squares, axis=0) / K + eps), h


@triton.jit
def row_norm_fp8_scale(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    norm_weight_ptr,
    input_scale_ptr,
    scale_ub,
    cols,
    eps,
    program,
    K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DYNAMIC: tl.constexpr,
    CAPPED: tl.constexpr,
):
    """(`row_inv_rms`'s inverse RMS of row 0, the e4m3 scale of its normed values): `rms_norm_fp8_quant`'s
    dynamic scale (the amax capped at scale_ub with CAPPED) or, not DYNAMIC, the static input_scale. For an
    FP8 linear that normalizes and quantizes its input tiles (`normed_tile`, then `quantize_e4m3`)."""
    inv_rms, h = row_inv_rms(x_ptr, residual_ptr, residual_out_ptr, cols, eps, program, K, HAS_RESIDUAL)
    if DYNAMIC:
        mask = cols < K
        normed = norm_rounded(h, inv_rms, tl.load(norm_weight_ptr + cols, mask=mask, other=0.0))
        amax = amax_keep_nan(tl.where(mask, tl.abs(normed.to(tl.float32)), 0.0), 0)
        scale = dynamic_scale(capped(amax, scale_ub, CAPPED))
    else:
        scale = tl.load(input_scale_ptr)
    return inv_rms, scale


@triton.jit
def normed_tile(x_ptr, residual_ptr, norm_weight_ptr, k, k_mask, inv_rms, HAS_RESIDUAL: tl.constexpr):
    """Row 0's normed values at columns k, [BLOCK_K] in x's dtype: `norm_rounded` of x (+ residual, rounded
    first) with the row's `row_inv_rms`; 0 past K. A linear broadcasts it over its padding rows (their
    outputs are never stored)."""
    h = tl.load(x_ptr + k, mask=k_mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + k, mask=k_mask, other=0.0)
        h = (h.to(tl.float32) + residual.to(tl.float32)).to(h.dtype)
    return norm_rounded(h, inv_rms, tl.load(norm_weight_ptr + k, mask=k_mask, other=0.0))


def check_row_norm(norm: RowNorm, x: torch.Tensor) -> None:
    """A linear's `norm=` for its input x [M, K] (the norm's input): at most NORM_MAX_ROWS rows, the weight
    [K] and the residual tensors [M, K] in x's dtype, residual_out with residual and apart from x and it.
    Raises ValueError naming the argument."""
    num_rows, in_features = x.shape
    if num_rows > NORM_MAX_ROWS:
        raise ValueError(f"x: at most {NORM_MAX_ROWS} row with a norm, got {num_rows}")
    check_tensor("norm.weight", norm.weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    check_shape("norm.weight", norm.weight, (in_features,))
    if (norm.residual is None) != (norm.residual_out is None):
        raise ValueError("norm: residual and residual_out go together")
    for name, tensor in (("norm.residual", norm.residual), ("norm.residual_out", norm.residual_out)):
        if tensor is not None:
            check_tensor(name, tensor, ndim=2, dtypes=(x.dtype,), device=x.device)
            check_shape(name, tensor, tuple(x.shape))
    if norm.residual_out is not None and norm.residual_out.data_ptr() in (
        x.data_ptr(),
        norm.residual.data_ptr(),
    ):  # one program writes it while the others still read x and residual
        raise ValueError("norm.residual_out: must not share memory with x or norm.residual")


def _check_rms_norm_args(x, weight, residual, warps) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, device=x.device)
    check_shape("weight", weight, (x.shape[1],))
    check_same_dtype("weight", weight, x.dtype)
    if residual is not None:
        check_tensor("residual", residual, ndim=2, device=x.device)
        check_shape("residual", residual, x.shape)
        check_same_dtype("residual", residual, x.dtype)
    if warps is not None:
        check_power_of_two("warps", warps, 1)
        if warps > MAX_WARPS:
            raise ValueError(f"warps: at most {MAX_WARPS}, got {warps}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [num_tokens, hidden] (after adding `residual` when given).

    Returns (normed, residual_out), both new [num_tokens, hidden] tensors in x's dtype; residual_out
    is the un-normalized input of the norm, i.e. the next layer's residual. Without `residual` it is x.
    `out` / `residual_out` may be given to write into (residual_out may alias residual: in-place add).
    `warps` (a power of two up to MAX_WARPS): the program's warps instead of `norm_warps`'s; on a GPU a
    row's sum of squares is then reduced in another order, so the result may round otherwise.
    """
    _check_rms_norm_args(x, weight, residual, warps)
    out = output_like("out", out, x)
    residual_out = output_like("residual_out", residual_out, x) if residual is not None else x
    _launch(x, weight, eps, residual, out, residual_out, warps=warps)
    return out, residual_out


def rms_norm_fp8_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    group_size: int | None = None,
    scale_ub: float | None = None,
    warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rms_norm` whose normed output goes straight to an FP8 linear: returns (x_q [T, hidden]
    float8_e4m3fn, x_scale [T, 1] float32, residual_out), what `quantize_fp8(rms_norm(...)[0],
    input_scale)` returns, bit for bit, and the same residual_out; the normed tensor itself is not
    written. Dynamic per-token scales without `input_scale`, else that static scale ([] or [1] float32
    on x's device, read by the kernel). With `group_size` (a power of two >= 16; no input_scale): x_scale
    [T, cdiv(hidden, group_size)], dynamic per row and group, what `quantize_fp8_groups(rms_norm(...)[0],
    group_size)` returns. With `scale_ub` (per token only), each row's amax is capped there first, as
    `quantize_fp8(..., scale_ub=)` caps it. Outputs are written into `out` / `scale_out` / `residual_out`
    when given. `warps`: as `rms_norm`'s (bit for bit `rms_norm(..., warps=)` then quantized), for the
    kernel bench's comparison. Raises ValueError naming a bad argument."""
    _check_rms_norm_args(x, weight, residual, warps)
    check_quantization(input_scale, group_size, x.device, scale_ub)
    out, scale_out = quantized_outputs(out, scale_out, x.shape[0], x.shape[1], x.device, group_size)
    residual_out = output_like("residual_out", residual_out, x) if residual is not None else x
    quantize = (scale_out, input_scale, group_size or 0, scale_ub)
    _launch(x, weight, eps, residual, out.view(torch.uint8), residual_out, quantize, warps)
    return out, scale_out, residual_out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    quantize: tuple[torch.Tensor, torch.Tensor | None, int, float | None] | None = None,
    warps: int | None = None,
) -> None:
    """One program per row of `warps` warps (default `norm_warps`); `quantize`: (scale_out, input_scale or
    None for dynamic scales, group size or 0 for a scale per row, the cap on a row's amax or None), with
    `out` the codes' uint8 view."""
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    scale_out, input_scale, group_size, scale_ub = quantize if quantize is not None else (None, None, 0, None)
    hidden_pad = triton.next_power_of_2(hidden)
    # A group wider than the padded row is the row, one group: the same padded width as `rms_norm`'s, so
    # that the row's sum of squares is reduced over the same threads in the same order (wider, a GPU summed
    # it otherwise: a scale one ulp off in fp32, run 16).
    group_size = min(group_size, hidden_pad)
    _rms_norm_kernel[(num_tokens,)](
        out,
        residual_out,
        x,
        residual if residual is not None else x,
        weight,
        scale_out,
        input_scale,
        scale_ub or 1.0,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        residual_out.stride(0),
        scale_out.stride(0) if scale_out is not None else 0,
        HIDDEN=hidden,
        HIDDEN_PAD=hidden_pad,
        HAS_RESIDUAL=residual is not None,
        QUANTIZE=quantize is not None,
        DYNAMIC=input_scale is None,
        GROUP_SIZE=group_size,
        CAPPED=scale_ub is not None,
        HW_E4M3=quantize is not None and gpu_e4m3(x.device),
        num_warps=warps or norm_warps(hidden_pad),
        **pdl_launch_options(x.device),
    )


MAX_WARPS = 32  # a CUDA block's 1,024 threads


def norm_warps(width: int) -> int:
    """Warps for a program holding a row of `width` (padded) columns: one per 256, 1 to 8."""
    return warps_for_columns(width, 8)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch version of `rms_norm` (the LlamaRMSNorm recipe)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x
