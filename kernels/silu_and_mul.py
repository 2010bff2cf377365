"""silu(gate) * up over a packed gate_up projection, in Triton (any float dtype, CUDA or the interpreter):

    x [num_tokens, 2 * d] = [gate | up]  ->  out [num_tokens, d] = silu(gate) * up

Rounded like the unfused model (`act_fn(gate_proj(x)) * up_proj(x)` in transformers): silu in fp32 and
rounded to x's dtype, then the product in fp32 and rounded again. One read of x and one write of out,
instead of ATen's silu (read gate, write) and mul (read both, write). The CPU path has its own C++
kernel (`sluice.kernels.cpu_silu_and_mul`).

Grid (num_tokens, cdiv(d, BLOCK)): BLOCK = 1024 columns per program (untuned; 4 warps).

`silu_and_mul_fp8_quant` writes, instead of out, its e4m3 codes and per-row fp32 scale for an FP8 linear
(dynamic per token, or a static input_scale): bit for bit `silu_and_mul` then
`sluice.kernels.fp8_quant.quantize_fp8` (the product rounded to x's dtype by the same jit helper, then
quantized by fp8_quant's). Grid (num_tokens,): one program per row, as fp8_quant's: a row of d up to
FP8_MAX_TILE is one tile kept in registers; a wider one is computed twice in FP8_MAX_TILE-wide tiles (amax,
then codes; the first tile kept), rereading x instead of writing and rereading out. With `group_size` (a
block-FP8 linear's input: a dynamic scale per row and group of group_size columns) it is bit for bit
`silu_and_mul` then `sluice.kernels.fp8_block_mm.quantize_fp8_groups`, and one pass: grid (num_tokens,
cdiv(groups, GROUPS)), a program activates and quantizes GROUPS whole groups of a row, a [GROUPS,
group_size] tile of up to GROUP_TILE columns, as `quantize_fp8_groups` tiles its input.

The FP8 linears that take a one-row step's [gate | up] row and activate it in their own loads
(`fp8_gated_skinny_mm`, `fp8_gated_gemv`: `KernelConfig.fuse_silu_fp8`) make the same values with
`silu_and_mul_tile` and the row's scale with `gated_row_fp8_scale`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
    max_keep_nan,
    quantized_outputs,
)
from sluice.kernels.store_kv import gpu_e4m3, quantize_e4m3
from sluice.kernels.tensor_checks import FLOAT_DTYPES, check_power_of_two, check_tensor, output_like

_BLOCK = 1024
# Columns the fused FP8 kernel holds at once: llama-3-8b's 14,336 (and every preset's intermediate size) in
# one pass, 16 values of gate and of up a thread at 32 warps. fp8_quant's 4,096 made it walk such rows twice
# in four tiles (amax, then codes): 8.9 us a launch at 64 rows on an H200 (run 11) against ~4.3 for the two
# unfused launches.
FP8_MAX_TILE = 16384
GROUP_TILE = 2048  # columns a program of the group-quantizing kernel holds at most (quantize_fp8_groups')


@triton.jit
def silu_and_mul_tile(x_row, cols, D: tl.constexpr):
    """silu(gate) * up at columns `cols` of the row at `x_row` ([gate | up], 2 * D wide), rounded to x's
    dtype as transformers rounds it; 0 where cols >= D."""
    mask = cols < D
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + D + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_row.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (activated * up).to(dtype)


GATED_AMAX_TILE = 2048  # columns of a gated row an FP8 linear's program activates at once for the amax


@triton.jit
def gated_row_fp8_scale(
    x_row, input_scale_ptr, scale_ub, D: tl.constexpr, TILE: tl.constexpr, DYNAMIC: tl.constexpr,
    CAPPED: tl.constexpr,
):  # fmt: skip
    """The e4m3 scale of the activated row silu(gate) * up at x_row ([gate | up], 2 * D wide): DYNAMIC,
    `silu_and_mul_fp8_quant`'s (the amax of the row's values in x's dtype, found in TILE-wide tiles: a max
    in any order is the same max; capped at scale_ub with CAPPED), else the static input_scale. For an FP8
    linear that activates and quantizes its input tiles itself (`silu_and_mul_tile`, then `quantize_e4m3`)."""
    if DYNAMIC:
        cols = tl.arange(0, TILE)
        running = tl.zeros([TILE], dtype=tl.float32)
        for start in range(0, D, TILE):
            running = max_keep_nan(running, tl.abs(silu_and_mul_tile(x_row, start + cols, D).to(tl.float32)))
        scale = dynamic_scale(capped(amax_keep_nan(running, 0), scale_ub, CAPPED))
    else:
        scale = tl.load(input_scale_ptr)
    return scale


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, x_ptr, stride_x, stride_out, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    wait_prior_kernel(PDL)
    out = silu_and_mul_tile(x_ptr + token * stride_x, cols, D)
    tl.store(out_ptr + token * stride_out + cols, out, mask=cols < D)


@triton.jit
def _silu_and_mul_fp8_kernel(
    out_ptr,  # [T, D] uint8: the e4m3 codes
    scale_ptr,  # [T, 1] float32: written
    x_ptr,  # [T, 2 * D]
    input_scale_ptr,  # static only: [] or [1] float32, read
    scale_ub,  # CAPPED only: the cap on the row's amax (float32)
    stride_x,
    stride_out,
    stride_scale,
    D: tl.constexpr,
    TILE: tl.constexpr,
    DYNAMIC: tl.constexpr,
    CAPPED: tl.constexpr,
    HW_E4M3: tl.constexpr,
    PDL: tl.constexpr = False,
):
    token = tl.program_id(0).to(tl.int64)
    wait_prior_kernel(PDL)
    x_row = x_ptr + token * stride_x
    out_row = out_ptr + token * stride_out
    cols = tl.arange(0, TILE)
    first = silu_and_mul_tile(x_row, cols, D)  # with D <= TILE the whole row, kept
    if DYNAMIC:
        running = tl.abs(first.to(tl.float32))
        for start in range(TILE, D, TILE):  # rows wider than a tile: first pass, amax
            tile = silu_and_mul_tile(x_row, start + cols, D)
            running = max_keep_nan(running, tl.abs(tile.to(tl.float32)))
        scale = dynamic_scale(capped(amax_keep_nan(running, 0), scale_ub, CAPPED))
    else:
        scale = tl.load(input_scale_ptr)
    tl.store(out_row + cols, quantize_e4m3(first, scale, HW_E4M3), mask=cols < D)
    for start in range(TILE, D, TILE):  # second pass: the codes of the other tiles
        tile = silu_and_mul_tile(x_row, start + cols, D)
        tl.store(out_row + start + cols, quantize_e4m3(tile, scale, HW_E4M3), mask=start + cols < D)
    tl.store(scale_ptr + token * stride_scale, scale)


@triton.jit
def _silu_and_mul_fp8_groups_kernel(
    out_ptr,  # [T, D] uint8: the e4m3 codes
    scale_ptr,  # [T, cdiv(D, GROUP_SIZE)] float32: written
    x_ptr,  # [T, 2 * D]
    num_groups,
    stride_x,
    stride_out,
    stride_scale,
    D: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUPS: tl.constexpr,
    HW_E4M3: tl.constexpr,
    PDL: tl.constexpr = False,
):
    token = tl.program_id(0).to(tl.int64)
    wait_prior_kernel(PDL)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [GROUPS, GROUP_SIZE]
    activated = silu_and_mul_tile(x_ptr + token * stride_x, cols, D)  # 0 past D: never in the amax
    codes, scales = out_ptr + token * stride_out, scale_ptr + token * stride_scale
    store_quantized_groups(codes, scales, activated, cols, groups, D, num_groups, HW_E4M3)


def check_gated_rows(x: torch.Tensor, name: str = "x") -> int:
    """d, half of x's last dim; ValueError naming `name` unless x is [num_tokens, 2 * d] = [gate | up] float,
    unit last stride (this module's launches, and the FP8 linears that activate such rows themselves)."""
    check_tensor(name, x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] % 2:
        raise ValueError(f"{name}: last dim must be even ([gate | up]), got {x.shape[1]}")
    return x.shape[1] // 2


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, 2 * d] (float, unit last stride) -> [num_tokens, d] = silu(x[:, :d]) * x[:, d:],
    written into `out` when given. Raises ValueError naming a bad argument."""
    d = check_gated_rows(x)
    num_tokens = x.shape[0]
    if out is None:
        out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    else:
        out = output_like("out", out, x[:, :d])
    if num_tokens == 0 or d == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        out, x, x.stride(0), out.stride(0), D=d, BLOCK=block, **pdl_launch_options(x.device)
    )
    return out


def silu_and_mul_fp8_quant(
    x: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    group_size: int | None = None,
    scale_ub: float | None = None,
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul(x)` going straight to an FP8 linear: (x_q [num_tokens, d] float8_e4m3fn, x_scale
    [num_tokens, 1] float32), bit for bit `quantize_fp8(silu_and_mul(x), input_scale)`; the activated
    tensor itself is not written. Dynamic per-token scales without `input_scale`, else that static scale
    ([] or [1] float32 on x's device, read by the kernel). With `group_size` (a power of two >= 16; no
    input_scale): x_scale [num_tokens, cdiv(d, group_size)], dynamic per row and group, what
    `quantize_fp8_groups(silu_and_mul(x), group_size)` returns. With `scale_ub` (per token only), each
    row's amax is capped there first, as `quantize_fp8(..., scale_ub=)` caps it. Written into `out` /
    `scale_out` when given. `tile` (per token or static; a power of two >= 16): the columns a program
    holds at once, one warp per 256 of them, instead of the whole row up to FP8_MAX_TILE; a row wider than
    the tile is walked twice (the same bits), for the kernel bench's long-row comparison. Raises ValueError
    naming a bad argument."""
    d = check_gated_rows(x)
    if d == 0:
        raise ValueError(f"x: rows must not be empty, got shape {tuple(x.shape)}")
    check_quantization(input_scale, group_size, x.device, scale_ub)
    if tile is not None:
        check_power_of_two("tile", tile, 16)
        if group_size is not None:
            raise ValueError("tile: per token or static scales only, not with group_size")
    num_tokens = x.shape[0]
    out, scale_out = quantized_outputs(out, scale_out, num_tokens, d, x.device, group_size)
    if num_tokens == 0:
        return out, scale_out
    if group_size is not None:
        num_groups = triton.cdiv(d, group_size)
        groups = min(triton.next_power_of_2(num_groups), max(1, GROUP_TILE // group_size))
        _silu_and_mul_fp8_groups_kernel[(num_tokens, triton.cdiv(num_groups, groups))](
            out.view(torch.uint8),
            scale_out,
            x,
            num_groups,
            x.stride(0),
            out.stride(0),
            scale_out.stride(0),
            D=d,
            GROUP_SIZE=group_size,
            GROUPS=groups,
            HW_E4M3=gpu_e4m3(x.device),
            num_warps=warps_for_columns(groups * group_size, 8),  # quantize_fp8_groups'
            **pdl_launch_options(x.device),
        )
        return out, scale_out
    tile = tile or min(triton.next_power_of_2(d), FP8_MAX_TILE)
    _silu_and_mul_fp8_kernel[(num_tokens,)](
        out.view(torch.uint8),
        scale_out,
        x,
        input_scale,
        scale_ub or 1.0,
        x.stride(0),
        out.stride(0),
        scale_out.stride(0),
        D=d,
        TILE=tile,
        DYNAMIC=input_scale is None,
        CAPPED=scale_ub is not None,
        HW_E4M3=gpu_e4m3(x.device),
        num_warps=warps_for_columns(tile, 32),
        **pdl_launch_options(x.device),
    )
    return out, scale_out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch version of `silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
