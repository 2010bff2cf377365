"""An FP8 linear for a few rows in one launch: activation quantization and the product fused, the weight
read once. The FP8 linears' batch-1 steps run it on their smaller weights (`fp8_linear.runs_gemv`: at most
2^24 elements) instead of `fp8_quant` followed by `torch._scaled_mm`.

    x_scale[m] = max(max_k |x[m, k]| / 448, tiny)   dynamic (per token), or the static input_scale
    x_q[m, k]  = e4m3(clamp(x[m, k] / x_scale[m], -448, 448))
    y[m, n]    = (sum_k x_q[m, k] * w_q[n, k]) * x_scale[m] * w_scale[n]      rounded to x's dtype once

The same numbers as the FP8 linears' other paths: x_q and x_scale are bit for bit `fp8_quant`'s (the same
jit functions), and the e4m3 products are exact in the fp32 accumulator, so y differs from `_scaled_mm`'s
(or the emulated CPU product's) only by the order of the fp32 sums.

Why: at decode sizes a linear is a read of its weight, and `_scaled_mm` reads it slowly there. On an H100
(docs/perf/, kernel_bench) fp8_quant + `_scaled_mm` took 22 / 18 / 55 us at one row for the 8b shape's qkv /
o / down projections, 1.1-1.2 TB/s and no faster than bf16's `F.linear` on twice the bytes: its 128-wide
tiles give 32-48 programs for 132 SMs. Here each program reads BLOCK_N output channels (4-16, chosen so that
every SM gets more than one program) in steps of BLOCK_K columns:

    partial [BLOCK_M, BLOCK_N, BLOCK_K] += w_tile [BLOCK_N, BLOCK_K] * x_q_tile [BLOCK_M, BLOCK_K]
    y [BLOCK_M, BLOCK_N] = sum over the last axis, once, at the end

on the CUDA cores in fp32 (the e4m3 codes widened exactly), M padded to a power of two. The work grows
with M, so only a few rows are taken (MAX_ROWS). Each program also quantizes its rows of x: a first pass
finds their amax, then every step quantizes its columns (x is small next to the weight, and read from L2).

Grid: (cdiv(N, BLOCK_N), split_k). `gemv_config` picks the tile: the best of an H100 sweep for the shapes
swept (the GPU check's `kernel_bench` step, docs/GPU.md), else a rule sized by the SM count.

Profiles on an H100 and an H200 found the kernel latency-bound on the 8b shape's qkv / o / down (1.4-1.9
TB/s, no faster on the H200's faster memory): a program waits for each step's weight tile before asking for
the next, and for the amax pass (K / block_k loads from L2, one after the other) before the first. Four
options, off by default until a GPU sweep (the kernel_bench step's one-row candidates) says where they pay:

    prefetch   the first tile is asked for before the amax pass, and each step asks for the next tile before
               multiplying this one (two tiles in flight); the same sums in the same order, bit for bit
    split_k    s programs per block_n channels, each over a contiguous 1/s of the columns (whole tiles);
               each writes its fp32 partial sums [M, N], and fp8_skinny_mm's split-K reduce adds the s of
               them in order and scales once: more programs in flight, shorter walks; y differs by the
               order of the fp32 sums
    stages     the product's loop pipelined by Triton (tl.range num_stages): each tile's weight and x are
               copied to shared memory asynchronously, stages - 1 steps ahead; the same sums, bit for bit,
               and fewer registers than prefetch (167 against 247 at 16x512, 4 warps: 3 programs on an
               SM, not 2), shared memory instead ((stages - 1) x 9 KB at that tile)
    amax_k     the amax pass in steps of amax_k columns instead of block_k (4096: one or four loads a row
               on the 8b shape instead of 4-28); a max in any order is the same max, so y is bit for bit

`fp8_normed_gemv` takes one row before its RMSNorm (qkv_proj in a one-row step, `KernelConfig.fuse_norm_fp8`):
NORM_K > 0 replaces the amax pass by `rms_norm`'s over the whole row (the residual added first; program
(0, 0) writes x + residual), and each x tile is normalized as it is loaded, with `rms_norm`'s jit helpers,
before it is quantized as above: bit for bit `rms_norm` then `fp8_gemv` under the interpreter. Untimed.
`fp8_gated_gemv` takes [gate | up] rows before SiLU-and-mul (down_proj in a one-row step,
`KernelConfig.fuse_silu_fp8`): GATED_D > 0 makes the amax pass and each product step activate the tiles they
load (`silu_and_mul`'s jit helper): bit for bit `silu_and_mul` then `fp8_gemv`. Untimed.

Split K sums its partials in a second launch (`split_k.reduce_split_k`), not in the last program of each
channel block to finish (an acq_rel counter per block): the reduce adds a launch to the graph (the sweep
times it, as its graph replays include it), but keeps no state between launches (a counter buffer that
must be zero before every replay, on every device, allocated before any graph is captured) and needs no
memory ordering, which the interpreter cannot check. `SkinnyConfig.fused_reduce` (split_k.py) is that
counter (off by default until a GPU run times it); if the GPU sweep finds this kernel's split K winning by
less than the reduce's launch, it is the next thing to bring here.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from sluice.kernels.fp8_quant import amax_keep_nan, capped, check_quantization, dynamic_scale, max_keep_nan
from sluice.kernels.rms_norm import RowNorm, check_row_norm, normed_tile, row_norm_fp8_scale
from sluice.kernels.silu_and_mul import check_gated_rows, silu_and_mul_tile
from sluice.kernels.split_k import reduce_split_k
from sluice.kernels.store_kv import quantize_e4m3
from sluice.kernels.tensor_checks import (
    FLOAT_DTYPES,
    check_num_warps,
    check_power_of_two,
    check_shape,
    check_tensor,
)

FP8 = torch.float8_e4m3fn
MAX_ROWS = 8  # the most rows a launch takes (its cost grows with them: no tensor cores)


@dataclass(frozen=True)
class GemvConfig:
    """One launch's tile: block_n output channels per program, block_k input columns per step at one row
    (block_k // BLOCK_M at BLOCK_M rows, at least 16: the partial sums stay block_n x block_k floats)."""

    block_n: int = 8
    block_k: int = 1024
    num_warps: int = 4
    prefetch: bool = False  # each weight tile's load issued a step ahead (the first before the amax pass)
    split_k: int = 1  # programs per block_n channels, each over a contiguous 1 / split_k of the columns
    amax_k: int = 0  # columns per step of the dynamic amax pass at one row (0: block_k's, as the product's)
    stages: int = 1  # > 1: the product's loop pipelined by Triton (tiles stages - 1 steps ahead, in smem)

    def __post_init__(self) -> None:
        check_power_of_two("block_n", self.block_n, 1)
        check_power_of_two("block_k", self.block_k, 16)
        check_num_warps(self.num_warps)
        if self.split_k not in (1, 2, 4, 8, 16):
            raise ValueError(f"split_k: must be 1, 2, 4, 8 or 16, got {self.split_k}")
        if self.amax_k:
            check_power_of_two("amax_k", self.amax_k, 16)
        if self.stages not in (1, 2, 3, 4):
            raise ValueError(f"stages: must be 1, 2, 3 or 4, got {self.stages}")

    def tile_k(self, block_m: int) -> int:
        return max(16, self.block_k // block_m)

    def amax_tile_k(self, block_m: int) -> int:
        return max(16, self.amax_k // block_m) if self.amax_k else self.tile_k(block_m)


TILE_BYTES = 8192  # the rule's weight bytes per program and step
MAX_RULE_BLOCK_N = 16  # wider tiles never won a sweep on the layers the gemv serves (docs/perf/)
MIN_PROGRAMS_PER_SM = 1.5  # the rule's narrowest grid: 192 programs on 132 SMs lost to 384, 256 won

# The best tile of the H100 sweep at one row (kernel_bench, 2026-11-26 run 5:
# docs/perf/fp8_linears_h100_2026-11-26_run5.md), by weight shape [out_features, in_features]; both down
# tiles from the H200's latency sweep (run 12: docs/perf/fp8_linears_h200_2026-11-29_run12.md), where a
# 4096-column amax pass and a 3-stage pipelined product beat run 5's tiles on both. Used where the device
# has as many SMs (an H100 SXM or an H200: 132); the rule elsewhere.
SWEPT_SM_COUNT = 132
SWEPT_TILES = {
    (6144, 4096): GemvConfig(16, 512, 4),  # llama-3-8b qkv: 15.6 us (the rule's tile then, 8x1024: 17.3)
    (4096, 4096): GemvConfig(16, 1024, 8),  # llama-3-8b o: 12.0 (4x2048: 15.9)
    (4096, 14336): GemvConfig(16, 512, 4, amax_k=4096, stages=3),  # llama-3-8b down: 29.1 (run 5's: 31.0)
    (3072, 2048): GemvConfig(8, 1024, 4),  # llama-3.2-1b qkv: 6.4 (4x2048: 8.4)
    (2048, 2048): GemvConfig(8, 1024, 4),  # llama-3.2-1b o: 5.7 (4x2048: 6.6)
    (2048, 8192): GemvConfig(8, 1024, 4, amax_k=4096, stages=3),  # llama-3.2-1b down: 11.2 (run 5's: 12.4)
}


def gemv_config(out_features: int, in_features: int, sm_count: int) -> GemvConfig:
    """The tile for a weight [out_features, in_features]: the swept one where there is one for this shape
    and SM count; else the widest block_n (4-16) that still gives every SM 1.5 programs, with block_k
    making the step's weight tile TILE_BYTES (at most 2048 columns), 4 warps. The rule gives the sweep's
    best tile on three of the six shapes above (both qkv, llama-3.2-1b's o); its timings on the other
    three were not kept."""
    swept = SWEPT_TILES.get((out_features, in_features)) if sm_count == SWEPT_SM_COUNT else None
    if swept is not None:
        return swept
    block_n = rule_block_n(out_features, sm_count)
    return GemvConfig(block_n=block_n, block_k=min(2048, TILE_BYTES // block_n))


def rule_block_n(out_features: int, sm_count: int) -> int:
    """The rule's output channels a program: the widest of 16, 8, 4 that still gives every one of
    `sm_count` SMs MIN_PROGRAMS_PER_SM programs (4 where none does)."""
    block_n = MAX_RULE_BLOCK_N
    while block_n > 4 and triton.cdiv(out_features, block_n) < MIN_PROGRAMS_PER_SM * sm_count:
        block_n //= 2
    return block_n


@triton.jit
def _e4m3_to_float(codes):
    """e4m3 codes (uint8) -> fp32, exact (every e4m3 value is an fp16 one; sm_89+: cvt.rn.f16x2.e4m3x2)."""
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _input_tile(x_rows, start, cols, mask, GATED_D: tl.constexpr):
    """x's values at columns start + `cols` ([1, C]) of the rows at `x_rows` ([BLOCK_M, 1]) in x's dtype,
    0 outside `mask`; GATED_D > 0: silu(gate) * up of the [gate | up] rows (`silu_and_mul`'s), 0 past
    GATED_D (the padding rows repeat row M - 1: their outputs are never stored)."""
    if GATED_D > 0:
        x = silu_and_mul_tile(x_rows, start + cols, GATED_D)
    else:
        x = tl.load(x_rows + start + cols, mask=mask, other=0.0)
    return x


@triton.jit
def _fp8_gemv_kernel(
    y_ptr,  # [M, N] x's dtype (SPLIT_K 1), or [SPLIT_K, M, N] float32 partial sums: written
    x_ptr,  # [M, K] bf16/fp16/fp32; GATED_D > 0: [M, 2 * K] = [gate | up]
    input_scale_ptr,  # static only: [] or [1] float32
    scale_ub,  # CAPPED only: the cap on each row's amax (float32)
    w_ptr,  # [N, K] uint8: the weight's e4m3 codes
    w_scale_ptr,  # [N] float32
    x_scale_out_ptr,  # SPLIT_K > 1: [M] float32, the rows' scales for the reduce (written once)
    norm_weight_ptr,  # NORM_K > 0: [K], x's dtype
    residual_ptr,  # NORM_K > 0 and HAS_RESIDUAL: [1, K]
    residual_out_ptr,  # NORM_K > 0 and HAS_RESIDUAL: [1, K], written by program (0, 0)
    eps,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AMAX_K: tl.constexpr,  # the amax pass's columns per step (its loads in flight: any width, same amax)
    DYNAMIC: tl.constexpr,
    PREFETCH: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
    CAPPED: tl.constexpr = False,  # DYNAMIC: each row's amax capped at scale_ub (fbgemm_fp8)
    PDL: tl.constexpr = False,  # `dependent_launch`: PREFETCH's first weight tile is loaded before the wait
    PREFETCH_BYTES: tl.constexpr = 0,  # PDL: each weight row's first bytes asked of L2 before the wait
    NORM_K: tl.constexpr = 0,  # > 0 (= K, M == 1): x is RMSNorm(x [+ residual]) of `rms_norm`, made here
    NORM_PAD: tl.constexpr = 16,  # NORM_K > 0: a power of two >= K
    HAS_RESIDUAL: tl.constexpr = False,
    GATED_D: tl.constexpr = 0,  # > 0 (= K): x is silu(gate) * up of x_ptr's [gate | up] rows, made here
):
    channels = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    channel_mask = channels < N
    row_mask = rows < M
    x_rows = tl.minimum(rows, M - 1) if GATED_D > 0 else rows  # gated: the padding rows read row M - 1
    x_rows = x_ptr + x_rows[:, None].to(tl.int64) * stride_x  # [BLOCK_M, 1]
    w_rows = w_ptr + channels[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]
    # This program's columns: whole tiles [k_lo, k_hi) (all of them when SPLIT_K is 1).
    split_len = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = tl.program_id(1) * split_len
    k_hi = tl.minimum(K, k_lo + split_len)
    if PREFETCH:  # the first tile's DRAM latency hides behind the amax pass's L2 reads
        w_next = tl.load(
            w_rows + k_lo + cols[None, :], mask=channel_mask[:, None] & (k_lo + cols < k_hi)[None, :], other=0
        )
    prefetch_weight_rows(w_ptr, channels, N, stride_w, k_lo, k_hi, PREFETCH_BYTES)
    wait_prior_kernel(PDL)

    if NORM_K > 0:  # the row's inverse RMS and its normed values' amax, `rms_norm`'s (program 0 writes x + r)
        inv_rms, norm_scale = row_norm_fp8_scale(
            x_ptr, residual_ptr, residual_out_ptr, norm_weight_ptr, input_scale_ptr, scale_ub,
            tl.arange(0, NORM_PAD), eps, tl.program_id(0) + tl.program_id(1), NORM_K, HAS_RESIDUAL, DYNAMIC,
            CAPPED,
        )  # fmt: skip
        x_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + norm_scale
    elif DYNAMIC:  # each row's amax over the whole row, as fp8_quant's kernel finds it
        amax_cols = tl.arange(0, AMAX_K)
        running = tl.zeros([BLOCK_M, AMAX_K], dtype=tl.float32)
        for start in range(0, K, AMAX_K):
            mask = row_mask[:, None] & (start + amax_cols < K)[None, :]
            x = _input_tile(x_rows, start, amax_cols[None, :], mask, GATED_D)
            running = max_keep_nan(running, tl.abs(x.to(tl.float32)))
        x_scale = dynamic_scale(capped(amax_keep_nan(running, 1), scale_ub, CAPPED))  # [BLOCK_M]
    else:
        x_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(input_scale_ptr)

    # Partial sums per (row, channel, column of the tile), reduced over the tile's columns once at the end.
    partial = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        col_mask = (start + cols < k_hi)[None, :]
        if PREFETCH:  # take the tile loaded a step ago, ask for the next (all masked past k_hi)
            w = w_next
            ahead = start + BLOCK_K
            w_next = tl.load(
                w_rows + ahead + cols[None, :],
                mask=channel_mask[:, None] & (ahead + cols < k_hi)[None, :],
                other=0,
            )
        else:
            w = tl.load(w_rows + start + cols[None, :], mask=channel_mask[:, None] & col_mask, other=0)
        if NORM_K > 0:  # the row's normed values in x's dtype, as `rms_norm` writes them
            k = start + cols
            normed = normed_tile(x_ptr, residual_ptr, norm_weight_ptr, k, k < k_hi, inv_rms, HAS_RESIDUAL)
            x = tl.broadcast_to(normed[None, :], (BLOCK_M, BLOCK_K))
        else:  # gated: split K takes whole tiles, so only columns past K are past k_hi (0 there)
            x = _input_tile(x_rows, start, cols[None, :], row_mask[:, None] & col_mask, GATED_D)
        # The integer conversion (HW_E4M3 False): a step's BLOCK_M x BLOCK_K codes beside BLOCK_N x BLOCK_K
        # weights cost little, and the GPU's made a tile of the one-row sweep spill on sm_90
        x_q = _e4m3_to_float(quantize_e4m3(x, x_scale[:, None], False))  # [BLOCK_M, BLOCK_K]
        partial += _e4m3_to_float(w)[None, :, :] * x_q[:, None, :]
    acc = tl.sum(partial, axis=2)  # [BLOCK_M, BLOCK_N]

    out_mask = row_mask[:, None] & channel_mask[None, :]
    if SPLIT_K == 1:
        w_scale = tl.load(w_scale_ptr + channels, mask=channel_mask, other=1.0)
        y = acc * x_scale[:, None] * w_scale[None, :]  # the emulated path's order: (y * x_scale) * w_scale
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + channels[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:  # this split's partial sums, which `split_k.reduce_split_k` adds up and scales
        part = y_ptr + (tl.program_id(1) * M + rows[:, None]).to(tl.int64) * N + channels[None, :]
        tl.store(part, acc, mask=out_mask)
        if tl.program_id(0) + tl.program_id(1) == 0:  # every program has the same scales: one writes them
            tl.store(x_scale_out_ptr + rows, x_scale, mask=row_mask)


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    scale_ub: float | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, M <= MAX_ROWS, unit last stride) @ weight [N, K] float8_e4m3fn (row-major)
    with weight_scale [N] float32 -> y [M, N] in x's dtype, x quantized per token (input_scale None) or by
    the static input_scale ([] or [1] float32), as module docstring; `scale_ub` (per token only) caps each
    row's amax, as `fp8_quant`'s. Nothing is read back to the host. Raises ValueError naming a bad
    argument."""
    _check_args(x, weight, weight_scale)
    check_quantization(input_scale, None, x.device, scale_ub)
    return _launch(x, weight, weight_scale, input_scale, config, scale_ub, None)


def fp8_normed_gemv(
    x: torch.Tensor,
    norm: RowNorm,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    scale_ub: float | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """`fp8_gemv` of one row's RMSNorm (`norm`, after its residual add), made as each tile is loaded: x
    [1, K] (or no rows) is the norm's input, the rest as `fp8_gemv`'s -> y [1, N] in x's dtype. The same
    numbers as `rms_norm(x, norm.weight, norm.eps, norm.residual)` then `fp8_gemv` (bit for bit under the
    interpreter; on a GPU the row's sum of squares is reduced over this launch's warps), and
    norm.residual_out gets that launch's residual_out. Each program reads the row once to sum its squares
    and find the normed row's amax, in place of its amax pass. Raises ValueError naming a bad argument."""
    _check_args(x, weight, weight_scale)
    check_row_norm(norm, x)
    check_quantization(input_scale, None, x.device, scale_ub)
    return _launch(x, weight, weight_scale, input_scale, config, scale_ub, norm)


def fp8_gated_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    scale_ub: float | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """`fp8_gemv` of silu(gate) * up, made as each tile is loaded: gate_up [M, 2 * K] = [gate | up] (M <=
    MAX_ROWS; bf16 / fp16 / fp32, unit last stride), the SiLU-gated MLP's gate_up output; weight [N, K] and
    the rest as `fp8_gemv`'s -> y [M, N] in gate_up's dtype. Bit for bit `silu_and_mul(gate_up)` then
    `fp8_gemv` (`silu_and_mul`'s jit helper makes each tile, in the amax pass and in the product). Raises
    ValueError naming a bad argument."""
    _check_args(gate_up, weight, weight_scale, check_gated_rows(gate_up, "gate_up"), "gate_up")
    check_quantization(input_scale, None, gate_up.device, scale_ub)
    return _launch(gate_up, weight, weight_scale, input_scale, config, scale_ub, None, gated=True)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    config: GemvConfig | None,
    scale_ub: float | None,
    norm: RowNorm | None,
    gated: bool = False,
) -> torch.Tensor:
    """The checked launch; with `norm`, x is the norm's input row; `gated`, x is [gate | up]."""
    num_rows = x.shape[0]
    out_features, in_features = weight.shape
    y = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return y
    if config is None:
        config = gemv_config(out_features, in_features, device_sm_count(x.device))
    block_m = triton.next_power_of_2(num_rows)
    split_k = config.split_k
    out, x_scale = y, None
    if split_k > 1:
        out = torch.empty((split_k, num_rows, out_features), dtype=torch.float32, device=x.device)
        x_scale = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    programs = triton.cdiv(out_features, config.block_n)
    tile_k = config.tile_k(block_m)
    # The columns a split takes, as the kernel cuts them (whole tiles)
    split_len = triton.cdiv(triton.cdiv(in_features, tile_k), split_k) * tile_k
    norm_weight, eps, residual, residual_out = norm if norm is not None else (None, 0.0, None, None)
    _fp8_gemv_kernel[(programs, split_k)](
        out,
        x,
        input_scale,
        scale_ub or 1.0,
        weight.view(torch.uint8),
        weight_scale,
        x_scale,
        norm_weight,
        residual,
        residual_out,
        eps,
        num_rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=tile_k,
        AMAX_K=config.amax_tile_k(block_m),
        DYNAMIC=input_scale is None,
        PREFETCH=config.prefetch,
        SPLIT_K=split_k,
        STAGES=config.stages,
        CAPPED=scale_ub is not None,
        PREFETCH_BYTES=weight_prefetch_bytes(x.device, programs * split_k, config.block_n, split_len),
        NORM_K=in_features if norm is not None else 0,
        NORM_PAD=triton.next_power_of_2(in_features) if norm is not None else 16,
        HAS_RESIDUAL=residual is not None,
        GATED_D=in_features if gated else 0,
        num_warps=config.num_warps,
        **pdl_launch_options(x.device),
    )
    if split_k > 1:
        reduce_split_k(y, out, (x_scale, weight_scale))
    return y


def _check_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    in_features: int | None = None,
    name: str = "x",
) -> None:
    """x (named `name`) [M, K'] float, M <= MAX_ROWS; weight [N, K] e4m3 with K = `in_features` (x's
    columns if None) and weight_scale [N] float32, on x's device."""
    check_tensor(name, x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{name}: at most {MAX_ROWS} rows, got shape {tuple(x.shape)}")
    check_tensor("weight", weight, ndim=2, dtypes=(FP8,), device=x.device)
    expected, whose = (x.shape[1], f"{name}'s") if in_features is None else (in_features, f"half {name}'s")
    if weight.shape[1] != expected:
        raise ValueError(f"weight: expected {expected} columns ({whose}), got shape {tuple(weight.shape)}")
    check_tensor("weight_scale", weight_scale, ndim=1, dtypes=(torch.float32,), device=x.device)
    check_shape("weight_scale", weight_scale, (weight.shape[0],))
