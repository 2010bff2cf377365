"""Block-wise FP8 linears (DeepSeek-V3 / Qwen3-FP8 checkpoints): the activations' group quantization and
the block-scaled product, each one Triton launch.

    weight     w_q [N, K] e4m3, w_scale [cdiv(N, block_n), cdiv(K, block_k)] float32 (one per weight block)
    quantize   x_scale[m, g] = max(max_{k in group g} |x[m, k]| / 448, float32 tiny)   groups of block_k
               x_q[m, k]     = e4m3(clamp(x[m, k] / x_scale[m, k // block_k], -448, 448))
    product    y[m, n] = sum_kb (sum_{k in kb} x_q[m, k] * w_q[n, k]) * x_scale[m, kb]
                                                                 * w_scale[n // block_n, kb]
               accumulated in fp32, rounded to out_dtype once

`quantize_fp8_groups` is bit for bit `fp8_blocks.quantize_activation_groups` (run on CPU), as
`fp8_quant` is its per-token function: amax in fp32, IEEE-exact divisions (`div_rn`), the codes made by
`store_kv.quantize_e4m3`; a NaN makes its group's scale and codes NaN. Grid (M, cdiv(groups, GROUPS)): a
program quantizes GROUPS groups of one row, a [GROUPS, group_size] tile.

`fp8_block_mm` follows vLLM's `w8a8_block_fp8_matmul`: grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)), BLOCK_K
== block_k, so each K step is one K block: its partial `tl.dot` (e4m3 operands, fp32 result) is scaled by
the [BLOCK_M] activation scales and the [BLOCK_N] weight scales of that block (read per column,
w_scale[n // block_n, kb], so BLOCK_N need not match block_n) and added to the fp32 accumulator. An 8-bit
`tl.dot` needs K >= 32 on NVIDIA GPUs: a block_k of 16 multiplies the codes widened to fp16 (exact).
`fp8_block_mm_reference` is the same formula in PyTorch, a loop over K blocks.

The tiles (`block_mm_tiles`; num_warps 4, num_stages 3) and the quantization's GROUPS are untuned. On an
H200 (runs 12-14) its tests passed, and over a burst of 64 prompts on the llama-3-8b shape (steps of up
to 2,048 tokens) a step spent 31.6 ms in it on average, against 10.7 ms in cuBLAS's per-channel FP8
product (docs/QUANTIZATION.md): prompts are where tuning would pay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.compile_target import warps_for_columns
from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.fp8_quant import amax_keep_nan, dynamic_scale
from sluice.kernels.store_kv import gpu_e4m3, quantize_e4m3
from sluice.kernels.tensor_checks import (
    FLOAT_DTYPES,
    check_power_of_two,
    check_shape,
    check_tensor,
    checked_output,
)

FP8 = torch.float8_e4m3fn
QUANT_TILE = 2048  # columns a quantization program holds at most (GROUPS * group_size)


@triton.jit
def store_quantized_groups(codes_ptr, scales_ptr, x, cols, groups, K, num_groups, HW_E4M3: tl.constexpr):
    """x [GROUPS, GROUP_SIZE], a row's columns `cols` (zeros past K: never in an amax), quantized per group
    as `quantize_fp8_groups` quantizes it: the codes stored at codes_ptr + cols, the groups' scales at
    scales_ptr + groups. Shared by the kernels that write a block linear's input (`rms_norm_fp8_quant`,
    `silu_and_mul_fp8_quant` with a group_size), so that their codes are these, bit for bit."""
    scale = dynamic_scale(amax_keep_nan(tl.abs(x.to(tl.float32)), 1))  # [GROUPS]
    tl.store(codes_ptr + cols, quantize_e4m3(x, scale[:, None], HW_E4M3), mask=cols < K)
    tl.store(scales_ptr + groups, scale, mask=groups < num_groups)


@triton.jit
def _quantize_groups_kernel(
    out_ptr,  # [M, K] uint8: the e4m3 codes
    scale_ptr,  # [M, num_groups] float32: written
    x_ptr,  # [M, K] bf16/fp16/fp32
    K,
    num_groups,
    stride_x,
    stride_out,
    stride_scale,
    GROUP_SIZE: tl.constexpr,
    GROUPS: tl.constexpr,
    HW_E4M3: tl.constexpr,
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [GROUPS, GROUP_SIZE]
    wait_prior_kernel(PDL)
    # the last group's missing columns load as zeros: its amax stays
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0)
    store_quantized_groups(
        out_ptr + row * stride_out, scale_ptr + row * stride_scale, x, cols, groups, K, num_groups, HW_E4M3
    )


@triton.jit
def _fp8_block_mm_kernel(
    y_ptr,  # [M, N] out dtype
    x_ptr,  # [M, K] uint8: x's e4m3 codes
    x_scale_ptr,  # [M, cdiv(K, BLOCK_K)] float32
    w_ptr,  # [N, K] uint8: the weight's e4m3 codes
    w_scale_ptr,  # [cdiv(N, SCALE_BLOCK_N), cdiv(K, BLOCK_K)] float32
    M,
    N,
    K,
    stride_x,
    stride_x_scale,
    stride_w,
    stride_w_scale,
    stride_y,
    SCALE_BLOCK_N: tl.constexpr,  # block_n: the weight rows that share a scale
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # block_k: one K step is one scale block
    PDL: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    wait_prior_kernel(PDL)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x  # [BLOCK_M, 1]
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_w  # [1, BLOCK_N]: w read transposed
    x_scales = x_scale_ptr + rows.to(tl.int64) * stride_x_scale
    w_scales = w_scale_ptr + (cols // SCALE_BLOCK_N).to(tl.int64) * stride_w_scale
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + ks
        k_mask = k < K  # the last block may be partial
        x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0)
        w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0)
        x = x.to(tl.float8e4nv, bitcast=True)
        w = w.to(tl.float8e4nv, bitcast=True)
        if BLOCK_K < 32:  # an 8-bit dot's smallest K: widen the codes (every e4m3 value is an fp16 one)
            x = x.to(tl.float16)
            w = w.to(tl.float16)
        partial = tl.dot(x, w)  # [BLOCK_M, BLOCK_N] fp32: this block's sums
        x_scale = tl.load(x_scales + kb, mask=row_mask, other=0.0)
        w_scale = tl.load(w_scales + kb, mask=col_mask, other=0.0)
        acc += partial * x_scale[:, None] * w_scale[None, :]
    y = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def quantize_fp8_groups(
    x: torch.Tensor,
    group_size: int,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, unit last stride, any row stride) -> (x_q [M, K] float8_e4m3fn, x_scale
    [M, cdiv(K, group_size)] float32), one scale per row and group of group_size columns (a power of two
    >= 16), bit for bit `quantize_activation_groups`. Written into `out` / `scale_out` when given. Raises
    ValueError naming a bad argument."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_rows, width = x.shape
    if width == 0:
        raise ValueError(f"x: rows must not be empty, got shape {tuple(x.shape)}")
    check_power_of_two("group_size", group_size, 16)
    num_groups = triton.cdiv(width, group_size)
    out = checked_output("out", out, (num_rows, width), FP8, x.device)
    scale_out = checked_output("scale_out", scale_out, (num_rows, num_groups), torch.float32, x.device)
    if num_rows == 0:
        return out, scale_out
    groups = min(triton.next_power_of_2(num_groups), max(1, QUANT_TILE // group_size))
    _quantize_groups_kernel[(num_rows, triton.cdiv(num_groups, groups))](
        out.view(torch.uint8),
        scale_out,
        x,
        width,
        num_groups,
        x.stride(0),
        out.stride(0),
        scale_out.stride(0),
        GROUP_SIZE=group_size,
        GROUPS=groups,
        HW_E4M3=gpu_e4m3(x.device),
        num_warps=warps_for_columns(groups * group_size, 8),
        **pdl_launch_options(x.device),
    )
    return out, scale_out


def block_mm_tiles(num_rows: int, out_features: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): the rows padded to 16-64; 64 output columns a tile up to 32 rows (more tiles for
    the SMs), 128 above. Untuned."""
    block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
    return block_m, 64 if num_rows <= 32 or out_features <= 64 else 128


def fp8_block_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x_q [M, K] float8_e4m3fn with x_scale [M, cdiv(K, block_k)] float32 @ w_q [N, K] float8_e4m3fn with
    w_scale [cdiv(N, block_n), cdiv(K, block_k)] float32, block = (block_n, block_k) powers of two >= 16
    -> y [M, N] out_dtype (bf16/fp16/fp32), as the module docstring; written into `out` when given. Every
    tensor has a unit last stride (any row stride). Raises ValueError naming a bad argument."""
    check_mm_args(x_q, x_scale, w_q, w_scale, block, out_dtype)
    num_rows, in_features = x_q.shape
    out_features = w_q.shape[0]
    y = checked_output("out", out, (num_rows, out_features), out_dtype, x_q.device)
    if num_rows == 0 or out_features == 0:
        return y
    block_m, block_n = block_mm_tiles(num_rows, out_features)
    _fp8_block_mm_kernel[(triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))](
        y,
        x_q.view(torch.uint8),
        x_scale,
        w_q.view(torch.uint8),
        w_scale,
        num_rows,
        out_features,
        in_features,
        x_q.stride(0),
        x_scale.stride(0),
        w_q.stride(0),
        w_scale.stride(0),
        y.stride(0),
        SCALE_BLOCK_N=block[0],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block[1],
        num_warps=4,
        num_stages=3,
        **pdl_launch_options(x_q.device),
    )
    return y


def fp8_block_mm_reference(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`fp8_block_mm` in PyTorch: each K block's product of the codes in fp32, times its scales, added in
    block order; rounded to out_dtype once. The same arguments and checks."""
    check_mm_args(x_q, x_scale, w_q, w_scale, block, out_dtype)
    block_n, block_k = block
    out_features, in_features = w_q.shape
    w_scale_rows = w_scale.repeat_interleave(block_n, dim=0)[:out_features]  # [N, num_k_blocks]
    y = torch.zeros((x_q.shape[0], out_features), dtype=torch.float32, device=x_q.device)
    for kb, start in enumerate(range(0, in_features, block_k)):
        columns = slice(start, start + block_k)
        partial = x_q[:, columns].float() @ w_q[:, columns].float().t()
        y += partial * x_scale[:, kb, None] * w_scale_rows[None, :, kb]
    return y.to(out_dtype)


def check_mm_args(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> None:
    """Raise ValueError naming the argument unless these are a block-scaled product's operands (as
    `fp8_block_mm` takes them; `fp8_skinny_mm.fp8_block_skinny_mm` shares them)."""
    check_tensor("x_q", x_q, ndim=2, dtypes=(FP8,))
    num_rows, in_features = x_q.shape
    if in_features == 0:
        raise ValueError(f"x_q: rows must not be empty, got shape {tuple(x_q.shape)}")
    check_block_weight(w_q, w_scale, block, in_features, x_q.device)
    check_tensor("x_scale", x_scale, ndim=2, dtypes=(torch.float32,), device=x_q.device)
    check_shape("x_scale", x_scale, (num_rows, triton.cdiv(in_features, block[1])))
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: {out_dtype} is not one of {FLOAT_DTYPES}")


def check_block_weight(
    w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], in_features: int, device: torch.device
) -> None:
    """Raise ValueError naming the argument unless `block` is (block_n, block_k), powers of two >= 16, and
    w_q [N, in_features] float8_e4m3fn with w_scale [cdiv(N, block_n), cdiv(in_features, block_k)] float32
    are on `device` (unit last strides)."""
    if not isinstance(block, tuple) or len(block) != 2:
        raise ValueError(f"block: expected (block_n, block_k), got {block!r}")
    for size in block:
        check_power_of_two("block", size, 16)
    block_n, block_k = block
    check_tensor("w_q", w_q, ndim=2, dtypes=(FP8,), device=device)
    out_features = w_q.shape[0]
    check_shape("w_q", w_q, (out_features, in_features))
    check_tensor("w_scale", w_scale, ndim=2, dtypes=(torch.float32,), device=device)
    check_shape("w_scale", w_scale, (triton.cdiv(out_features, block_n), triton.cdiv(in_features, block_k)))
