"""An FP8 linear for a few to 64 rows on the tensor cores: the weight as the product's tall operand
("swap AB") and its columns split over several programs ("split-K"), so that a decode step's skinny product
gives every SM work.

    y[m, n] = (sum_k x_q[m, k] * w_q[n, k]) * x_scale[m] * w_scale[n]      rounded to out_dtype once

x_q and x_scale are `fp8_quant`'s (per token or static), w_q the layer's e4m3 weight with its per-channel
scales: the same numbers as the FP8 linears' `_scaled_mm` path. The e4m3 products are exact; on a Hopper
GPU the tensor cores add each K tile's in less than fp32 before it joins the fp32 accumulator
(`max_num_imprecise_acc`), elsewhere (the interpreter) y differs only by the order of the fp32 sums.

Why: at 16-64 rows `_scaled_mm` reads the 8b shape's qkv / o / down weights at 1.0-1.3 TB/s (H100,
docs/perf/fp8_linears_h100_2026-11-26_first.md; o at 64 rows was slower than bf16's `F.linear` on twice
the bytes): with M that small its 128-wide output tiles give 32-64 programs for 132 SMs. Here a program
computes BLOCK_N output channels for all rows (BLOCK_M, the rows padded to 16-64, is the MMA's narrow side)
over a slice of K:

    grid (cdiv(N, BLOCK_N), SPLIT_K)
    acc [BLOCK_N, BLOCK_M] += dot(w_tile [BLOCK_N, BLOCK_K], x_q_tile^T [BLOCK_K, BLOCK_M])   (e4m3, fp32 acc)

With SPLIT_K == 1 the program scales and stores y; otherwise its fp32 partial sums go to a workspace and
are added in a fixed order and scaled by a second launch, or by each channel block's last split with
`SkinnyConfig.fused_reduce` (off by default): `sluice.kernels.split_k`, which `skinny_mm` and `fp8_gemv`
share. `skinny_config` picks BLOCK_N and SPLIT_K from the SM count (at least 1.5 programs per SM), or an
H100 sweep's config for the shapes where it did better.

`fp8_normed_skinny_mm` is the launch for one row taken before its RMSNorm (qkv_proj and gate_up_proj in
a one-row step, `KernelConfig.fuse_norm_fp8`: the norm's launch folded in): x is the norm's float input
(NORM_K > 0), and each program first reads the whole row (and residual) to get `rms_norm`'s inverse RMS
and the normed row's amax (`rms_norm_fp8_quant`'s dynamic scale, capped or static as the scheme says),
then normalizes and quantizes each x tile as it loads it with the same jit helpers; program (0, 0) writes
x + residual and the scale (for the reduce launch: this launch never takes the fused reduce, whose last
split would read the scale before its writer may have stored it). Under the interpreter bit for bit
`rms_norm_fp8_quant` then `fp8_skinny_mm`. Each tile's codes are made for the one row and broadcast over
the padding rows (whose outputs are never stored). Compiled for sm_90, 62-64 registers at bf16 (58 without
the norm), no spills (docs/perf/kernels_sm90.md); untimed on a GPU.

`fp8_gated_skinny_mm` is the launch for one row taken before SiLU-and-mul (down_proj in a one-row step,
`KernelConfig.fuse_silu_fp8`): x is gate_up's [1, 2 * K] row (GATED_D > 0), each program first activates
the whole row in GATED_TILE-wide tiles for its amax (`silu_and_mul_fp8_quant`'s dynamic scale; capped or
static as the scheme says), then activates and quantizes each x tile as it loads it, with the same jit
helpers (`silu_and_mul_tile`, `gated_row_fp8_scale`); program (0, 0) writes the scale for the reduce. Bit
for bit `silu_and_mul_fp8_quant` then `fp8_skinny_mm` on any device. Untimed on a GPU.

`fp8_block_skinny_mm` is the same launch for block-wise FP8 (DeepSeek-V3 / Qwen3-FP8: `fp8_block_mm`'s
operands, x_scale [M, cdiv(K, block_k)], w_scale [cdiv(N, block_n), cdiv(K, block_k)]): BLOCK_K == block_k,
so each K step is one scale block, whose dot is scaled by its [BLOCK_M] activation and [BLOCK_N] weight
scales as it joins the accumulator (`fp8_block_mm`'s formula); the splits hold whole K blocks and their
already scaled partial sums are added by the same reduce, unscaled. `block_skinny_config`: the same rule with
BLOCK_K = block_k. Its GPU tests passed on an H200 (run 13, in tests/test_kernels_fp8_block_mm.py); its
config is the rule's, unswept (timings: docs/QUANTIZATION.md).
"""

from __future__ import annotations

from typing import NamedTuple

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
from sluice.kernels.fp8_block_mm import check_mm_args
from sluice.kernels.fp8_quant import check_quantization
from sluice.kernels.rms_norm import RowNorm, check_row_norm, normed_tile, row_norm_fp8_scale
from sluice.kernels.silu_and_mul import (
    GATED_AMAX_TILE,
    check_gated_rows,
    gated_row_fp8_scale,
    silu_and_mul_tile,
)
from sluice.kernels.split_k import (
    SkinnyConfig,
    add_splits_if_last,
    reduce_split_k,
    scale_row_stride,
    split_counters,
    split_k_output,
    split_k_rule,
    split_program,
    workspace_offsets,
)
from sluice.kernels.store_kv import gpu_e4m3, quantize_e4m3
from sluice.kernels.tensor_checks import FLOAT_DTYPES, check_shape, check_tensor

FP8 = torch.float8_e4m3fn
MAX_ROWS = 64  # the most rows a launch takes: BLOCK_M, the MMA's narrow side, is at most 64
GATED_MAX_ROWS = 1  # each program of `fp8_gated_skinny_mm` activates its whole row first for the amax


class RowInput(NamedTuple):
    """A one-row launch's float input, made into codes in its loads: normed by `norm`, or (None) gated
    ([gate | up]); with the static input_scale (None: per token) and the amax cap (None: none)."""

    norm: RowNorm | None
    input_scale: torch.Tensor | None
    scale_ub: float | None


SWEPT_SM_COUNT = 132  # the SM count of the GPU the table below was swept on (an H100 SXM)
# (out_features, in_features) -> ((up to this many rows, config), ...): the H100 sweep's best where it beat
# the rule's config by more than a few percent (the GPU check's kernel_bench, 2026-11-26 run 9, one sample
# each: docs/perf/fp8_linears_h100_2026-11-26_run9.md); the rows between swept sizes take the next bucket's.
SWEPT_CONFIGS = {
    (28672, 4096): (  # llama-3-8b gate_up
        (
            16,
            SkinnyConfig(block_n=32, num_stages=3),
        ),  # 45.6 / 46.5 us at 2 / 16 rows (the rule's: 47.4 / 48.3)
        (MAX_ROWS, SkinnyConfig(block_n=128, num_stages=3)),  # 52.6 us at 64 rows (the rule's: 66.8)
    ),
}


def skinny_config(out_features: int, in_features: int, sm_count: int, num_rows: int) -> SkinnyConfig:
    """The swept config where the table has this shape, SM count and row count; else BLOCK_N 64, BLOCK_K 128,
    and the fewest K splits (powers of two, each at least BLOCK_K wide) giving every SM 1.5 programs."""
    if sm_count == SWEPT_SM_COUNT:
        for most_rows, swept in SWEPT_CONFIGS.get((out_features, in_features), ()):
            if num_rows <= most_rows:
                return swept
    return split_k_rule(SkinnyConfig(), out_features, in_features, sm_count)


def block_skinny_config(out_features: int, in_features: int, sm_count: int, block_k: int) -> SkinnyConfig:
    """`skinny_config`'s rule for block scales: BLOCK_N 64, BLOCK_K = block_k (one K step is one scale
    block), the fewest K splits giving every SM 1.5 programs. Untuned: no sweep has run it."""
    return split_k_rule(SkinnyConfig(block_k=block_k), out_features, in_features, sm_count)


@triton.jit
def _fp8_skinny_kernel(
    out_ptr,  # SPLIT_K == 1: y [M, N] out dtype; else the workspace [SPLIT_K, M, N] float32
    y_ptr,  # FUSED_REDUCE only: y [M, N] out dtype
    counter_ptr,  # FUSED_REDUCE only: [>= cdiv(N, BLOCK_N)] int32, zero before the launch (and after it)
    x_ptr,  # [M, K] uint8: x's e4m3 codes; a row input: [1, K] the norm's float input, gated [1, 2 * K]
    x_scale_ptr,  # [M] float32 ([1]: x_scale_stride 0); blocks: [M, cdiv(K, BLOCK_K)]; a row input: written
    w_ptr,  # [N, K] uint8: the weight's e4m3 codes
    w_scale_ptr,  # [N] float32; blocks: [cdiv(N, SCALE_BLOCK_N), cdiv(K, BLOCK_K)]
    norm_weight_ptr,  # NORM_K > 0: [K], x's dtype
    residual_ptr,  # NORM_K > 0 and HAS_RESIDUAL: [1, K]
    residual_out_ptr,  # NORM_K > 0 and HAS_RESIDUAL: [1, K], written by program (0, 0)
    input_scale_ptr,  # a row input (NORM_K or GATED_D > 0), not DYNAMIC: [] or [1] float32, read
    scale_ub,  # a row input and CAPPED: the cap on the row's amax (float32)
    eps,
    M,
    N,
    K,
    k_per_split,
    stride_x,
    stride_w,
    x_scale_stride,  # between rows' scales
    w_scale_stride,  # blocks only: between block rows' scales
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr = 0,  # block_n of block scales (BLOCK_K is then block_k); 0: per channel
    FUSED_REDUCE: tl.constexpr = False,  # SPLIT_K > 1 only: the last split of a channel block adds them up
    PDL: tl.constexpr = False,
    PREFETCH_BYTES: tl.constexpr = 0,  # PDL: each weight row's first bytes asked of L2 before the wait
    NORM_K: tl.constexpr = 0,  # > 0 (= K, M == 1): x is quantized RMSNorm(x [+ residual]), made here
    NORM_PAD: tl.constexpr = 16,  # NORM_K > 0: a power of two >= K
    HAS_RESIDUAL: tl.constexpr = False,
    GATED_D: tl.constexpr = 0,  # > 0 (= K, M == 1): x is quantized silu(gate) * up of [gate | up], made here
    GATED_TILE: tl.constexpr = 16,  # GATED_D > 0: columns activated at once for the row's amax
    DYNAMIC: tl.constexpr = True,  # a row input: its scale from its amax, else input_scale
    CAPPED: tl.constexpr = False,  # a row input, DYNAMIC: the amax capped at scale_ub
    HW_E4M3: tl.constexpr = False,  # a row input: the GPU's e4m3 conversion (`store_kv.gpu_e4m3`)
):
    channels, split, k_start, k_end = split_program(K, k_per_split, BLOCK_N)
    prefetch_weight_rows(w_ptr, channels, N, stride_w, k_start, k_end, PREFETCH_BYTES)
    wait_prior_kernel(PDL)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    channel_mask = channels < N
    row_mask = rows < M
    w_rows = w_ptr + channels[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]
    x_cols = x_ptr + rows[None, :].to(tl.int64) * stride_x  # [1, BLOCK_M]
    program = tl.program_id(0) + split
    if NORM_K > 0:  # `rms_norm_fp8_quant`'s inverse RMS and scale of the row; program (0, 0) writes them
        inv_rms, row_scale = row_norm_fp8_scale(
            x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, input_scale_ptr, scale_ub,
            tl.arange(0, NORM_PAD), eps, program, NORM_K, HAS_RESIDUAL, DYNAMIC, CAPPED,
        )  # fmt: skip
    elif GATED_D > 0:  # `silu_and_mul_fp8_quant`'s scale of the activated row
        row_scale = gated_row_fp8_scale(
            x_ptr, input_scale_ptr, scale_ub, GATED_D, GATED_TILE, DYNAMIC, CAPPED
        )
    if NORM_K > 0 or GATED_D > 0:
        tl.store(x_scale_ptr, row_scale, mask=program == 0)  # for the reduce launch
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SCALE_BLOCK_N > 0:
        x_scales = x_scale_ptr + rows.to(tl.int64) * x_scale_stride  # [BLOCK_M]
        w_scales = w_scale_ptr + (channels // SCALE_BLOCK_N).to(tl.int64) * w_scale_stride  # [BLOCK_N]
    for start in range(k_start, k_end, BLOCK_K):
        k = start + cols
        k_mask = k < k_end
        w = tl.load(w_rows + k[None, :], mask=channel_mask[:, None] & k_mask[None, :], other=0)
        if NORM_K > 0 or GATED_D > 0:  # the row's values in x's dtype, then their codes, as the launch before
            if NORM_K > 0:  # would write them (`rms_norm_fp8_quant`, `silu_and_mul_fp8_quant`)
                row = normed_tile(x_ptr, residual_ptr, norm_weight_ptr, k, k_mask, inv_rms, HAS_RESIDUAL)
            else:  # K slices are whole tiles: only columns past K are past k_end, 0 here
                row = silu_and_mul_tile(x_ptr, k, GATED_D)
            x = tl.broadcast_to(quantize_e4m3(row, row_scale, HW_E4M3)[:, None], (BLOCK_K, BLOCK_M))
        else:
            x = tl.load(x_cols + k[:, None], mask=k_mask[:, None] & row_mask[None, :], other=0)
        w_codes, x_codes = w.to(tl.float8e4nv, bitcast=True), x.to(tl.float8e4nv, bitcast=True)
        if SCALE_BLOCK_N > 0:  # one K block: its sums scaled by its scales (fp8_block_mm's formula)
            if BLOCK_K < 32:  # an 8-bit dot's smallest K: widen the codes (every e4m3 value is an fp16 one)
                w_codes, x_codes = w_codes.to(tl.float16), x_codes.to(tl.float16)
            kb = start // BLOCK_K
            x_scale = tl.load(x_scales + kb, mask=row_mask, other=0.0)
            w_scale = tl.load(w_scales + kb, mask=channel_mask, other=0.0)
            acc += tl.dot(w_codes, x_codes) * x_scale[None, :] * w_scale[:, None]
        else:
            # max_num_imprecise_acc: Hopper's fp8 MMA adds in less than fp32 (outputs 1.2-1.5% off at fp32
            # on the H100); each K tile's products go into the fp32 accumulator as one sum, as in the
            # block-scaled FP8 kernels of vLLM and SGLang
            acc = tl.dot(w_codes, x_codes, acc, max_num_imprecise_acc=BLOCK_K)
    out_mask = row_mask[None, :] & channel_mask[:, None]
    if SPLIT_K == 1 and SCALE_BLOCK_N > 0:  # already scaled
        y = out_ptr + rows[None, :] * N + channels[:, None]
        tl.store(y, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    elif SPLIT_K == 1:
        if NORM_K > 0 or GATED_D > 0:
            x_scale = tl.where(row_mask, row_scale, 0.0)
        else:
            x_scale = tl.load(x_scale_ptr + rows * x_scale_stride, mask=row_mask, other=0.0)
        w_scale = tl.load(w_scale_ptr + channels, mask=channel_mask, other=0.0)
        y = acc * x_scale[None, :] * w_scale[:, None]
        tl.store(
            out_ptr + rows[None, :] * N + channels[:, None], y.to(out_ptr.dtype.element_ty), mask=out_mask
        )
    else:
        partial = out_ptr + workspace_offsets(split, rows[None, :], channels[:, None], M, N)
        tl.store(partial, acc, mask=out_mask)
        if FUSED_REDUCE:
            add_splits_if_last(
                y_ptr, out_ptr, counter_ptr, x_scale_ptr, w_scale_ptr, rows, channels, out_mask, M, N,
                x_scale_stride, SPLIT_K, SCALE_BLOCK_N == 0,
            )  # fmt: skip


def fp8_skinny_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x_q [M, K] float8_e4m3fn (M <= MAX_ROWS, unit last stride) with x_scale [M, 1] or [1] float32 @ weight
    [N, K] float8_e4m3fn (row-major) with weight_scale [N] float32 -> y [M, N] out_dtype, as the module
    docstring. Raises ValueError naming a bad argument."""
    _check_args(x_q, x_scale, weight, weight_scale)
    num_rows, in_features = x_q.shape
    if config is None:
        config = skinny_config(weight.shape[0], in_features, device_sm_count(x_q.device), num_rows)
    elif config.block_k < 32:  # block scales' 16 widen their codes; per channel the dot takes e4m3
        raise ValueError(f"config: block_k must be at least 32 (an 8-bit dot's K), got {config.block_k}")
    return _launch(x_q, x_scale, weight, weight_scale, out_dtype, config, None)


def fp8_block_skinny_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype = torch.bfloat16,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """`sluice.kernels.fp8_block_mm.fp8_block_mm`'s product (the same arguments and checks; M <= MAX_ROWS)
    on this module's swapped, split-K launch: y [M, N] out_dtype. `config.block_k` must be block_k.
    Raises ValueError naming a bad argument."""
    check_mm_args(x_q, x_scale, w_q, w_scale, block, out_dtype)
    num_rows, in_features = x_q.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"x_q: at most {MAX_ROWS} rows, got {num_rows}")
    if config is None:
        config = block_skinny_config(w_q.shape[0], in_features, device_sm_count(x_q.device), block[1])
    elif config.block_k != block[1]:
        raise ValueError(f"config: block_k {config.block_k} must be the blocks' {block[1]}")
    return _launch(x_q, x_scale, w_q, w_scale, out_dtype, config, block[0])


def fp8_normed_skinny_mm(
    x: torch.Tensor,
    norm: RowNorm,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    scale_ub: float | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """`fp8_skinny_mm` of one row's RMSNorm (`norm`, after its residual add) quantized per token (capped at
    `scale_ub` if given) or by the static `input_scale`, made as each tile is loaded: x [1, K] (or no rows)
    bf16 / fp16 / fp32, the norm's input; weight and weight_scale as `fp8_skinny_mm`'s -> y [1, N] in x's
    dtype. The same codes and scale as `rms_norm_fp8_quant(x, norm.weight, norm.eps, norm.residual,
    input_scale, scale_ub=scale_ub)` then `fp8_skinny_mm` (bit for bit under the interpreter; on a GPU the
    row's sum of squares is reduced over this launch's warps), and norm.residual_out gets that launch's
    residual_out. Never `fused_reduce` (its last split would read the scale another program writes): the
    splits are added by the reduce launch. Raises ValueError naming a bad argument."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_row_norm(norm, x)
    check_quantization(input_scale, None, x.device, scale_ub)
    _check_weight(weight, weight_scale, x)
    return _launch_row_input(x, weight, weight_scale, config, RowInput(norm, input_scale, scale_ub))


def fp8_gated_skinny_mm(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    scale_ub: float | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """`fp8_skinny_mm` of one row's silu(gate) * up quantized per token (capped at `scale_ub` if given) or
    by the static `input_scale`, made as each tile is loaded: gate_up [1, 2 * K] (or no rows) bf16 / fp16 /
    fp32 = [gate | up], the SiLU-gated MLP's gate_up output; weight [N, K] and weight_scale as
    `fp8_skinny_mm`'s -> y [1, N] in gate_up's dtype. The same codes and scale as
    `silu_and_mul_fp8_quant(gate_up, input_scale, scale_ub=scale_ub)` then `fp8_skinny_mm` (bit for bit:
    the same jit helpers, and an amax is the same in any order); each program first activates the whole row
    to find its amax (dynamic). Never `fused_reduce`, as `fp8_normed_skinny_mm`. Raises ValueError naming a
    bad argument."""
    in_features = check_gated_rows(gate_up, "gate_up")
    if gate_up.shape[0] > GATED_MAX_ROWS:
        raise ValueError(f"gate_up: at most {GATED_MAX_ROWS} row, got {gate_up.shape[0]}")
    check_quantization(input_scale, None, gate_up.device, scale_ub)
    _check_weight(weight, weight_scale, gate_up, in_features)
    return _launch_row_input(gate_up, weight, weight_scale, config, RowInput(None, input_scale, scale_ub))


def _launch_row_input(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    config: SkinnyConfig | None,
    row_input: RowInput,
) -> torch.Tensor:
    """The launch on a checked float row (`row_input` says which): y in x's dtype, x_scale written by the
    kernel (for the reduce launch)."""
    num_rows = x.shape[0]
    if config is None:
        config = skinny_config(*weight.shape, device_sm_count(x.device), num_rows)
    elif config.block_k < 32:
        raise ValueError(f"config: block_k must be at least 32 (an 8-bit dot's K), got {config.block_k}")
    x_scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    return _launch(x, x_scale, weight, weight_scale, x.dtype, config, None, row_input)


def _launch(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: SkinnyConfig,
    scale_block_n: int | None,
    row_input: RowInput | None = None,
) -> torch.Tensor:
    """The checked launch: per-channel scales (`scale_block_n` None) or block scales with block_n rows;
    x the e4m3 codes, or with `row_input` the float row it names (the norm's input, or [gate | up]),
    x_scale then written by the kernel."""
    num_rows, out_features = x.shape[0], weight.shape[0]
    in_features = weight.shape[1]
    y = torch.empty((num_rows, out_features), dtype=out_dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return y
    block_m = max(16, triton.next_power_of_2(num_rows))
    k_per_split, split_k, out = split_k_output(y, in_features, config)
    blocks = scale_block_n is not None
    channel_blocks = triton.cdiv(out_features, config.block_n)
    fused_reduce = config.fused_reduce and split_k > 1 and row_input is None
    counters = split_counters(y.device, channel_blocks) if fused_reduce else None
    row_norm, input_scale, scale_ub = row_input if row_input is not None else (None, None, None)
    norm_weight, eps, residual, residual_out = row_norm if row_norm is not None else (None, 0.0, None, None)
    gated = row_input is not None and row_norm is None
    _fp8_skinny_kernel[(channel_blocks, split_k)](
        out,
        y if counters is not None else None,
        counters,
        x if row_input is not None else x.view(torch.uint8),
        x_scale,
        weight.view(torch.uint8),
        weight_scale,
        norm_weight,
        residual,
        residual_out,
        input_scale,
        scale_ub or 1.0,
        eps,
        num_rows,
        out_features,
        in_features,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        x_scale.stride(0) if blocks else scale_row_stride(x_scale),
        weight_scale.stride(0) if blocks else 0,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split_k,
        SCALE_BLOCK_N=scale_block_n or 0,
        FUSED_REDUCE=counters is not None,
        PREFETCH_BYTES=weight_prefetch_bytes(y.device, channel_blocks * split_k, config.block_n, k_per_split),
        NORM_K=in_features if row_norm is not None else 0,
        NORM_PAD=triton.next_power_of_2(in_features) if row_norm is not None else 16,
        HAS_RESIDUAL=residual is not None,
        GATED_D=in_features if gated else 0,
        GATED_TILE=min(GATED_AMAX_TILE, triton.next_power_of_2(in_features)) if gated else 16,
        DYNAMIC=input_scale is None,
        CAPPED=scale_ub is not None,
        HW_E4M3=row_input is not None and gpu_e4m3(y.device),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch_options(y.device),
    )
    if split_k > 1 and counters is None:
        reduce_split_k(y, out, None if blocks else (x_scale, weight_scale))
    return y


def _check_args(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> None:
    check_tensor("x_q", x_q, ndim=2, dtypes=(FP8,))
    num_rows = x_q.shape[0]
    if num_rows > MAX_ROWS:
        raise ValueError(f"x_q: at most {MAX_ROWS} rows, got {num_rows}")
    _check_weight(weight, weight_scale, x_q)
    check_tensor("x_scale", x_scale, ndim=x_scale.dim(), dtypes=(torch.float32,), device=x_q.device)
    if x_scale.numel() not in (1, num_rows) or not x_scale.is_contiguous():
        raise ValueError(
            f"x_scale: must hold 1 or {num_rows} contiguous scales, got shape {tuple(x_scale.shape)}"
        )


def _check_weight(
    weight: torch.Tensor, weight_scale: torch.Tensor, x: torch.Tensor, in_features: int | None = None
) -> None:
    """weight [N, K] e4m3 (K: `in_features`, x's columns if None) with weight_scale [N] float32, on x's
    device."""
    check_tensor("weight", weight, ndim=2, dtypes=(FP8,), device=x.device)
    out_features = weight.shape[0]
    check_shape("weight", weight, (out_features, x.shape[1] if in_features is None else in_features))
    check_tensor("weight_scale", weight_scale, ndim=1, dtypes=(torch.float32,), device=x.device)
    check_shape("weight_scale", weight_scale, (out_features,))
