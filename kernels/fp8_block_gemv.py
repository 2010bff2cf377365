"""A block-wise FP8 linear for a few rows in one launch: the activations' group quantization and the
block-scaled product fused, the weight read once. No layer runs it since the H200's run 12
(docs/perf/fp8_linears_h200_2026-11-29_run12.md): at one row it took 0.85-4.4x the time of
`quantize_fp8_groups` + `fp8_block_mm` on the llama-3-8b / llama-3.2-1b linears, and longer than
`fp8_skinny_mm.fp8_block_skinny_mm` at two rows on all of them, so the block linears' one-row steps take
that (`fp8_linear.block_runs_skinny`). Kept, with its tests and `fp8_linear_bench`'s "block gemv" column, as
the one-launch design a retuned tile would be measured against.

    weight     w_q [N, K] e4m3, w_scale [cdiv(N, block_n), cdiv(K, block_k)] float32 (one per weight block)
    quantize   x_scale[m, g] = max(max_{k in group g} |x[m, k]| / 448, float32 tiny)   groups of block_k
               x_q[m, k]     = e4m3(clamp(x[m, k] / x_scale[m, k // block_k], -448, 448))
    product    y[m, n] = sum_g (sum_{k in g} x_q[m, k] * w_q[n, k]) * x_scale[m, g] * w_scale[n // block_n, g]
               in fp32, rounded to x's dtype once

The same numbers as the block linears' other path: x_q and x_scale are bit for bit `quantize_fp8_groups`'
(the same jit functions: fp8_quant's amax and scale, store_kv's e4m3 rounding), a group's e4m3 products are
exact in fp32, and each group's sum is scaled in `fp8_block_mm_reference`'s order, so y differs from
`fp8_block_mm`'s only by the order of the fp32 sums.

Why: `fp8_block_mm` pads one row to a 16-row tensor-core tile and gives each program 64 output columns, so
at one row most of a Hopper GPU's SMs wait (llama-3-8b's o_proj: 64 programs for 132 SMs), as `_scaled_mm`'s
did before `fp8_gemv`. Here each program reads BLOCK_N output channels (4-16, so that every SM gets more
than one program) in steps of GROUPS activation groups:

    x tile [BLOCK_M, GROUPS, block_k]   loaded, each group's amax and scale found, quantized in registers
    w tile [BLOCK_N, GROUPS, block_k]   the e4m3 codes, widened to fp32 (exact)
    acc [BLOCK_M, BLOCK_N]             += sum over the groups of (sum over the group's columns of the
                                          products) * x_scale * w_scale

on the CUDA cores. A group is quantized where it is multiplied, so unlike `fp8_gemv` (a row's one scale
needs the whole row first) there is no amax pass before the first weight load. M is padded to a power of
two and GROUPS shrinks with it (the products stay BLOCK_M x BLOCK_N x GROUPS x block_k floats); only a few
rows are taken (MAX_ROWS).

The tile (`block_gemv_config`: fp8_gemv's rule, no sweep yet) is untuned; its GPU tests passed on an H200
(run 13).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sluice.kernels.compile_target import device_sm_count
from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.fp8_block_mm import check_block_weight
from sluice.kernels.fp8_gemv import MAX_ROWS, TILE_BYTES, rule_block_n
from sluice.kernels.fp8_quant import amax_keep_nan, dynamic_scale
from sluice.kernels.store_kv import gpu_e4m3, quantize_e4m3
from sluice.kernels.tensor_checks import (
    FLOAT_DTYPES,
    check_num_warps,
    check_power_of_two,
    check_tensor,
    checked_output,
)

__all__ = ["MAX_ROWS", "BlockGemvConfig", "block_gemv_config", "fp8_block_gemv"]


@dataclass(frozen=True)
class BlockGemvConfig:
    """One launch's tile: block_n output channels per program, `groups` activation groups (of block_k
    columns) per step at one row (groups // BLOCK_M at BLOCK_M rows, at least one)."""

    block_n: int = 16
    groups: int = 4
    num_warps: int = 4

    def __post_init__(self) -> None:
        check_power_of_two("block_n", self.block_n, 1)
        check_power_of_two("groups", self.groups, 1)
        check_num_warps(self.num_warps)

    def step_groups(self, block_m: int) -> int:
        return max(1, self.groups // block_m)


def block_gemv_config(out_features: int, in_features: int, group_size: int, sm_count: int) -> BlockGemvConfig:
    """fp8_gemv's rule for a weight [out_features, in_features] in groups of `group_size` columns: the widest
    block_n (4-16) that still gives every SM 1.5 programs, and as many groups a step as make the step's
    weight tile TILE_BYTES (no more than the row has), 4 warps. Unswept."""
    block_n = rule_block_n(out_features, sm_count)
    groups = max(1, TILE_BYTES // (block_n * group_size))
    return BlockGemvConfig(block_n, min(groups, triton.next_power_of_2(triton.cdiv(in_features, group_size))))


@triton.jit
def _fp8_block_gemv_kernel(
    y_ptr,  # [M, N] x's dtype: written
    x_ptr,  # [M, K] bf16/fp16/fp32
    w_ptr,  # [N, K] uint8: the weight's e4m3 codes
    w_scale_ptr,  # [cdiv(N, SCALE_BLOCK_N), cdiv(K, GROUP_SIZE)] float32
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_w_scale,
    stride_y,
    SCALE_BLOCK_N: tl.constexpr,  # block_n: the weight rows that share a scale
    GROUP_SIZE: tl.constexpr,  # block_k: an activation group's and a weight block's columns
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,  # groups a step
    HW_E4M3: tl.constexpr,  # the GPU's e4m3 conversion (`store_kv.gpu_e4m3`)
    PDL: tl.constexpr = False,
):
    channels = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    wait_prior_kernel(PDL)
    step_groups = tl.arange(0, GROUPS)
    group_cols = step_groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [GROUPS, GROUP_SIZE]
    channel_mask = channels < N
    row_mask = rows < M
    x_rows = x_ptr + rows[:, None, None].to(tl.int64) * stride_x  # [BLOCK_M, 1, 1]
    w_rows = w_ptr + channels[:, None, None].to(tl.int64) * stride_w  # [BLOCK_N, 1, 1]
    w_scales = w_scale_ptr + (channels // SCALE_BLOCK_N)[:, None].to(tl.int64) * stride_w_scale  # [N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, GROUPS * GROUP_SIZE):
        cols = start + group_cols
        col_mask = (cols < K)[None, :, :]  # the last group's missing columns load as zeros: its amax stays
        x = tl.load(x_rows + cols[None, :, :], mask=row_mask[:, None, None] & col_mask, other=0.0)
        x_scale = dynamic_scale(amax_keep_nan(tl.abs(x.to(tl.float32)), 2))  # [BLOCK_M, GROUPS]
        x_q = quantize_e4m3(x, x_scale[:, :, None], HW_E4M3).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w = tl.load(w_rows + cols[None, :, :], mask=channel_mask[:, None, None] & col_mask, other=0)
        w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BLOCK_N, GROUPS, GROUP_SIZE], exact
        partial = tl.sum(x_q[:, None, :, :] * w[None, :, :, :], axis=3)  # [BLOCK_M, BLOCK_N, GROUPS]
        groups = start // GROUP_SIZE + step_groups
        w_scale = tl.load(
            w_scales + groups[None, :],
            mask=channel_mask[:, None] & (groups * GROUP_SIZE < K)[None, :],
            other=0.0,
        )  # [BLOCK_N, GROUPS]; past K the products are 0
        acc += tl.sum(partial * x_scale[:, None, :] * w_scale[None, :, :], axis=2)
    y = y_ptr + rows[:, None].to(tl.int64) * stride_y + channels[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & channel_mask[None, :])


def fp8_block_gemv(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    config: BlockGemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, M <= MAX_ROWS, unit last stride) @ w_q [N, K] float8_e4m3fn with w_scale
    [cdiv(N, block_n), cdiv(K, block_k)] float32, block = (block_n, block_k) powers of two >= 16 -> y [M, N]
    in x's dtype, x quantized per row and group of block_k columns, as the module docstring; written into
    `out` when given. Nothing is read back to the host. Raises ValueError naming a bad argument."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_rows, in_features = x.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"x: at most {MAX_ROWS} rows, got shape {tuple(x.shape)}")
    if in_features == 0:
        raise ValueError(f"x: rows must not be empty, got shape {tuple(x.shape)}")
    check_block_weight(w_q, w_scale, block, in_features, x.device)
    out_features = w_q.shape[0]
    y = checked_output("out", out, (num_rows, out_features), x.dtype, x.device)
    if num_rows == 0 or out_features == 0:
        return y
    block_n, group_size = block
    if config is None:
        config = block_gemv_config(out_features, in_features, group_size, device_sm_count(x.device))
    block_m = triton.next_power_of_2(num_rows)
    _fp8_block_gemv_kernel[(triton.cdiv(out_features, config.block_n),)](
        y,
        x,
        w_q.view(torch.uint8),
        w_scale,
        num_rows,
        out_features,
        in_features,
        x.stride(0),
        w_q.stride(0),
        w_scale.stride(0),
        y.stride(0),
        SCALE_BLOCK_N=block_n,
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        GROUPS=config.step_groups(block_m),
        HW_E4M3=gpu_e4m3(x.device),
        num_warps=config.num_warps,
        **pdl_launch_options(x.device),
    )
    return y
