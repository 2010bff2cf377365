"""A float linear (bf16, fp16; fp32 for the interpreter's tests) for 1 to 64 rows: `fp8_skinny_mm`'s launch
on unquantized weights, so that a decode step's bf16 linears can be Sluice's own instead of cuBLAS's.

    y[m, n] = sum_k x[m, k] * w[n, k]      fp32 accumulator, rounded to x's dtype once

As `fp8_skinny_mm`: the weight is the product's tall operand ("swap AB"), a program computes BLOCK_N output
channels for all rows (BLOCK_M, the rows padded to 16-64, the MMA's narrow side) over a slice of K, and K is
split over programs (`split_k_rule`: every SM gets 1.5 programs) with the fp32 partial sums added by the same
reduce launch (`reduce_split_k`, unscaled), in split order:

    grid (cdiv(N, BLOCK_N), SPLIT_K)
    acc [BLOCK_N, BLOCK_M] += dot(w_tile [BLOCK_N, BLOCK_K], x_tile^T [BLOCK_K, BLOCK_M])

BLOCK_K is 64 (`float_skinny_config`): the FP8 launch's 128 columns in bytes. With programmatic dependent
launch (sm_90+) each program asks L2 for the first bytes of its weight rows before it waits for the kernel
ahead of it (`sluice.kernels.dependent_launch`), so a linear starts streaming its weight while the norm,
SiLU-and-mul or attention before it still runs.

`gated=True` (a SiLU-gated MLP's down_proj, `KernelConfig.fuse_silu_skinny`): x is the gate_up projection's
[M, 2 * K] = [gate | up] and each x tile is made as it is loaded, silu(gate) * up by `silu_and_mul`'s own
jit helper (the same roundings), so y is bit for bit `skinny_mm(silu_and_mul(x), w)` with one launch and
one write and read of the activated rows fewer (16 launches of the 1b's step, 32 of the 8b's).

`norm=RowNorm(weight, eps, residual, residual_out)` (qkv_proj and gate_up_proj after the decoder's RMSNorms,
`KernelConfig.fuse_norm_skinny`; one row, NORM_MAX_ROWS): x is the norm's input and each x tile is
normalized as it is loaded, `rms_norm`'s formula and roundings (x + residual rounded to x's dtype first;
weight * (h * inv_rms) rounded twice). Each program first reads the whole row (and residual) once to sum
its squares (one [next_power_of_2(K)] load each, L2 hits after the first program), and program (0, 0)
writes x + residual to residual_out, a buffer of its own (the other programs are still reading x and
residual). Under the interpreter that is bit for bit `rms_norm` then `skinny_mm`; on a GPU the sum of
squares is reduced over this launch's warps, not `rms_norm`'s, so y may differ by a last-bit rounding of
the normed row. 32 launches of the 1b's batch-1 step fewer (both norms of its 16 layers).

Why: on an H200 (run 15, docs/perf/) cuBLAS's bf16 linears of the llama-3.2-1b batch-1 graph step read
their weights at ~68% of the copy rate, 800 us of the 1,299 us step, where the step's goal (issue 33) is 879
us in all; the FP8 skinny launch reads the llama-3-8b FP8 step's qkv / gate_up / down weights at ~83% of
it. Whether this launch does as well on bf16 weights, and whether its early weight stream pays, is the GPU
check's `pdl` section's "bf16 skinny" rows (`KernelConfig.skinny_linears`, off by default): written and
checked under the interpreter on 2026-12-01, never timed on a GPU. fp32 operands multiply in IEEE fp32
(not TF32), a correctness path only; under the interpreter bf16 tiles are widened to fp32 before the dot
(`dot_settings`: its bf16 products are wrong there), the same exact products.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sluice.kernels.compile_target import device_sm_count
from sluice.kernels.dependent_launch import (
    pdl_launch_options,
    prefetch_weight_rows,
    wait_prior_kernel,
    weight_prefetch_bytes,
)
from sluice.kernels.fp8_skinny_mm import MAX_ROWS
from sluice.kernels.paged_attention_tile import dot_settings
from sluice.kernels.rms_norm import RowNorm, check_row_norm, normed_tile, row_inv_rms
from sluice.kernels.silu_and_mul import silu_and_mul_tile
from sluice.kernels.split_k import (
    SkinnyConfig,
    reduce_split_k,
    split_k_output,
    split_k_rule,
    split_program,
    workspace_offsets,
)
from sluice.kernels.tensor_checks import check_shape, check_tensor

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLOAT_BLOCK_K = 64  # columns per step: 128 bytes of a bf16 row, as the FP8 launch's 128 e4m3 columns


@functools.cache  # a few shapes a model, asked at every eager launch
def float_skinny_config(out_features: int, in_features: int, sm_count: int) -> SkinnyConfig:
    """BLOCK_N 64, BLOCK_K 64 and `split_k_rule`'s K splits (every SM 1.5 programs). Untuned: no sweep has
    run it."""
    return split_k_rule(SkinnyConfig(block_k=FLOAT_BLOCK_K), out_features, in_features, sm_count)


@triton.jit
def _skinny_kernel(
    out_ptr,  # SPLIT_K == 1: y [M, N] x's dtype; else the workspace [SPLIT_K, M, N] float32
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    norm_weight_ptr,  # NORM_K > 0: [K], x's dtype
    residual_ptr,  # NORM_K > 0 and HAS_RESIDUAL: [1, K]
    residual_out_ptr,  # NORM_K > 0 and HAS_RESIDUAL: [1, K], written by program (0, 0)
    eps,
    M,
    N,
    K,
    k_per_split,
    stride_x,
    stride_w,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ELEMENT_BYTES: tl.constexpr,  # the weight's
    INPUT_PRECISION: tl.constexpr,  # `dot_settings`': "ieee" for fp32 operands
    UPCAST: tl.constexpr,  # `dot_settings`': bf16 widened to fp32 before the dot (the interpreter only)
    GATED_D: tl.constexpr = 0,  # > 0: x_ptr holds [gate | up] rows, each GATED_D (= K) wide
    NORM_K: tl.constexpr = 0,  # > 0 (= K, M == 1): x is RMSNorm(x [+ residual]) of `rms_norm`, made here
    NORM_PAD: tl.constexpr = 16,  # NORM_K > 0: a power of two >= K
    HAS_RESIDUAL: tl.constexpr = False,
    PDL: tl.constexpr = False,
    PREFETCH_BYTES: tl.constexpr = 0,  # PDL: each weight row's first bytes asked of L2 before the wait
):
    channels, split, k_start, k_end = split_program(K, k_per_split, BLOCK_N)
    prefetch_weight_rows(w_ptr, channels, N, stride_w, k_start, k_end, PREFETCH_BYTES, ELEMENT_BYTES)
    wait_prior_kernel(PDL)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    channel_mask = channels < N
    row_mask = rows < M
    w_rows = w_ptr + channels[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]
    x_rows = tl.minimum(rows, M - 1) if GATED_D > 0 else rows  # gated: the padding rows read row M - 1
    x_cols = x_ptr + x_rows[None, :].to(tl.int64) * stride_x  # [1, BLOCK_M]
    if NORM_K > 0:  # the row's inverse RMS, as `rms_norm` makes it; program (0, 0) writes x + residual
        norm_cols = tl.arange(0, NORM_PAD)
        inv_rms, _ = row_inv_rms(
            x_ptr, residual_ptr, residual_out_ptr, norm_cols, eps, tl.program_id(0) + split,
            NORM_K, HAS_RESIDUAL,
        )  # fmt: skip
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for start in range(k_start, k_end, BLOCK_K):
        k = start + cols
        k_mask = k < k_end
        w = tl.load(w_rows + k[None, :], mask=channel_mask[:, None] & k_mask[None, :], other=0.0)
        if GATED_D > 0:  # K slices are whole tiles: only the last split's last tile passes K, masked here
            x = silu_and_mul_tile(x_cols, k[:, None], GATED_D)
        elif NORM_K > 0:
            normed = normed_tile(x_ptr, residual_ptr, norm_weight_ptr, k, k_mask, inv_rms, HAS_RESIDUAL)
            x = tl.broadcast_to(normed[:, None], (BLOCK_K, BLOCK_M))
        else:
            x = tl.load(x_cols + k[:, None], mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        if UPCAST:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, x, acc, input_precision=INPUT_PRECISION)
    out_mask = row_mask[None, :] & channel_mask[:, None]
    if SPLIT_K == 1:
        y = out_ptr + rows[None, :] * N + channels[:, None]
        tl.store(y, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(
            out_ptr + workspace_offsets(split, rows[None, :], channels[:, None], M, N), acc, mask=out_mask
        )


def skinny_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: SkinnyConfig | None = None,
    gated: bool = False,
    norm: RowNorm | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, unit last stride) @ weight [N, K] (row-major, x's dtype: bfloat16, float16
    or float32) -> y [M, N] in x's dtype, as the module docstring; `config` None: `float_skinny_config`.
    `gated`: x is [M, 2 * K] = [gate | up] and the product's input is silu(gate) * up, bit for bit
    `sluice.kernels.silu_and_mul.silu_and_mul(x)` (its jit helper), made as each tile is loaded.
    Raises ValueError naming a bad argument."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    if num_rows > MAX_ROWS:
        raise ValueError(f"x: at most {MAX_ROWS} rows, got {num_rows}")
    if gated:
        if in_features % 2:
            raise ValueError(f"x: gated rows are [gate | up], an even width, got {in_features}")
        in_features //= 2
    check_shape("weight", weight, (out_features, in_features))
    if norm is not None:
        if gated:
            raise ValueError("norm: a normed input is not a gated one (gated=True)")
        check_row_norm(norm, x)
    if config is None:
        config = float_skinny_config(out_features, in_features, device_sm_count(x.device))
    y = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return y
    k_per_split, split_k, out = split_k_output(y, in_features, config)
    channel_blocks = triton.cdiv(out_features, config.block_n)
    row_bytes = k_per_split * weight.element_size()
    input_precision, upcast = dot_settings(x.dtype)
    norm_weight, eps, residual, residual_out = norm if norm is not None else (None, 0.0, None, None)
    _skinny_kernel[(channel_blocks, split_k)](
        out,
        x,
        weight,
        norm_weight,
        residual,
        residual_out,
        eps,
        num_rows,
        out_features,
        in_features,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(num_rows)),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split_k,
        ELEMENT_BYTES=weight.element_size(),
        GATED_D=in_features if gated else 0,
        NORM_K=in_features if norm is not None else 0,
        NORM_PAD=triton.next_power_of_2(in_features) if norm is not None else 16,
        HAS_RESIDUAL=residual is not None,
        INPUT_PRECISION=input_precision,
        UPCAST=upcast,
        PREFETCH_BYTES=weight_prefetch_bytes(y.device, channel_blocks * split_k, config.block_n, row_bytes),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch_options(y.device),
    )
    if split_k > 1:
        reduce_split_k(y, out, None)
    return y
