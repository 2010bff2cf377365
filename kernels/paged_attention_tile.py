"""Attention over a paged KV cache tile by tile, shared by the decode and prefill kernels: one tile
(`attend_paged_tile`), the walk over a span of tiles (`attend_paged_span`), and the cut of a context into
split-KV slices (`split_context`).

A tile is N context positions of one sequence and one KV head. Position p lives at
    cache[block_table[p // BLOCK_SIZE], p % BLOCK_SIZE, kv_head, :]
so each tile looks up its block-table entries (one gathered load of N int32, a few distinct blocks)
and then gathers K^T [D, N] and V [N, D]. The step scores the query rows against K, masks what a row
may not see and folds the tile into the running online softmax, in base 2 (scores are pre-multiplied
by log2(e), so exp2 replaces exp; all fp32):
    m' = max(m, rowmax(s));  l' = l * 2^(m - m') + rowsum(2^(s - m'));  acc' = acc * 2^(m - m') + 2^(s - m') V
A row that sees nothing yet (a sliding window starts later for later rows) keeps m' = -inf; its
exponentials are taken against 0 instead, so they are 0, never NaN.

MASKED = False is the fast path for tiles every row sees wholly (FlashAttention-2's off-diagonal
tiles): no position mask on the loads and no `where` on the scores. MASKED = True takes
[kv_lo, kv_hi) as the positions that may be loaded (never a freed block before a window, never past
the context) and, with CAUSAL, each row's own causal and sliding-window limits.

FP8_KV = True reads an FP8 cache (its uint8 view). The K/V scales are one float per layer, so the
tile needs no per-value scaling (FOLD_KV_SCALES, as vLLM's and SGLang's Triton attention do it):
    q . (k_code * k_scale) = k_scale * (q . k_code);   p . (v_code * v_scale) = v_scale * (p . v_code)
FOLD_KV_SCALES = True converts each loaded tile of e4m3 codes straight to the dot's operand dtype
(`upcast_e4m3`: exact, every e4m3 value is an fp16, bf16 and fp32 value), the kernel multiplies the
scores' scale by k_scale once (`fold_k_scale`) and its accumulator by v_scale once, before normalizing
(`unfold_v_scale`; softmax's sum does not involve V, so each split's output is scaled alike). With unit
scales (`--kv-cache-dtype fp8` without checkpoint scales) this is bit for bit the other path; otherwise
K and V are not rounded to the model dtype after scaling, so it differs from `dequantize_kv`'s values by
that rounding (and cannot overflow fp16 where code * scale would). FOLD_KV_SCALES = False is the
earlier path, exactly `fp8_kv_cache.dequantize_kv`: each tile is dequantized in registers,
(float32(code) * scale).to(KV_DTYPE) (`dequantize_e4m3`), so the rest of the step runs on the same
numbers as over a model-dtype cache holding those values. The scales are loaded once per program
(`load_kv_scales`). The code -> float step (exact in any correct implementation) is E4M3_UPCAST, picked
by the launcher (`e4m3_upcast`): the GPU's own conversion where it has e4m3 (sm_89+:
cvt.rn.f16x2.e4m3x2, two codes an instruction), integer bit moves elsewhere (sm_80). FP8_KV = False is
the model-dtype path, untouched: no scale is loaded or applied.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sluice.kernels.store_kv import gpu_e4m3, load_store_scales

LOG2_E = 1.4426950408889634


def dot_settings(dtype: torch.dtype) -> tuple[str, bool]:
    """(input_precision, upcast) for `tl.dot` on `dtype` tiles.

    fp32 uses exact "ieee" products (the tests compare with a 2e-5 tolerance). Triton's interpreter
    multiplies bfloat16 operands wrongly (numpy has no bfloat16), so under TRITON_INTERPRET=1 bf16
    tiles are widened to fp32 right before each dot: the products of two bf16 numbers are exact in
    fp32 and the GPU's tensor cores accumulate in fp32 too, so only the summation order differs.
    """
    upcast = dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    return ("ieee" if dtype == torch.float32 or upcast else "tf32"), upcast


# E4M3_UPCAST values: how `dequantize_e4m3` turns codes into floats.
E4M3_CVT = "cvt"  # Triton's fp8e4nv -> fp32 (sm_89+ lowers it to cvt.rn.f16x2.e4m3x2)
E4M3_BITS = "bits"  # integer bit moves into an fp16 (GPUs without e4m3: Triton refuses fp8e4nv there)
# Triton's interpreter upcasts every code exactly but reads 0x7F / 0xFF (NaN) as +-480: E4M3_CVT plus a
# `where` that puts the NaN back, so the interpreted tests run the conversion the GPU runs.
E4M3_CVT_INTERPRETED = "cvt_interpreted"
# The launchers' FOLD_KV_SCALES when the caller does not pick (`fold_kv_scales=None`): both paths are
# tested, and the GPU check's kernel_bench step times each (benchmarks/gpu/fp8_kv_paths.py). On an H100
# (docs/perf/fp8_linears_h100_2026-11-26.md) folding ran 1.01-1.04x the dequantizing path's speed in
# decode and 0.93x in a 2k prefill, one sample each.
DEFAULT_FOLD_KV_SCALES = True


def folds_kv_scales(fp8_kv: bool, fold_kv_scales: bool | None) -> bool:
    """A launch's FOLD_KV_SCALES: the caller's choice (None: DEFAULT_FOLD_KV_SCALES) on an FP8 cache,
    False on a model-dtype one (no scales; one compiled variant, whatever the caller asked)."""
    if fold_kv_scales is None:
        fold_kv_scales = DEFAULT_FOLD_KV_SCALES
    return fp8_kv and fold_kv_scales


def e4m3_upcast(device: torch.device) -> str:
    """E4M3_UPCAST for a launch on `device`: E4M3_CVT on a CUDA GPU with e4m3 (compute capability 8.9+)
    and off a GPU (AOT compiles target sm_90; scripts/compile_kernels.py picks E4M3_BITS for older
    targets); E4M3_CVT_INTERPRETED under TRITON_INTERPRET=1; E4M3_BITS on older GPUs (`gpu_e4m3`)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return E4M3_CVT_INTERPRETED
    return E4M3_CVT if gpu_e4m3(device) else E4M3_BITS


@triton.jit
def load_kv_scales(k_scale_ptr, v_scale_ptr, FP8_KV: tl.constexpr):
    """(k_scale, v_scale) as `dequantize_e4m3` takes them, read once per program (`load_store_scales`);
    unread and unused on the model-dtype path (the pointers are None there)."""
    return load_store_scales(k_scale_ptr, v_scale_ptr, FP8_KV)


@triton.jit
def fold_k_scale(qk_scale, k_scale, FP8_KV: tl.constexpr, FOLD_KV_SCALES: tl.constexpr):
    """The scores' scale as the tiles apply it: qk_scale * k_scale where the codes enter the dot unscaled."""
    if FP8_KV and FOLD_KV_SCALES:
        qk_scale = qk_scale * k_scale
    return qk_scale


@triton.jit
def unfold_v_scale(acc, v_scale, FP8_KV: tl.constexpr, FOLD_KV_SCALES: tl.constexpr):
    """The accumulator (sum of p . v_code) times v_scale where the codes entered the dot unscaled."""
    if FP8_KV and FOLD_KV_SCALES:
        acc = acc * v_scale
    return acc


@triton.jit
def upcast_e4m3(codes, DTYPE: tl.constexpr, E4M3_UPCAST: tl.constexpr):
    """e4m3 codes (uint8) -> their values in DTYPE (fp16, bf16 or fp32), exactly: bit for bit torch's
    `codes.view(float8_e4m3fn).to(DTYPE)`. 0x7F / 0xFF (NaN, never stored from a finite K/V) give NaN.

    E4M3_CVT: the codes bitcast to fp8e4nv and converted (sm_89+: one cvt per two codes to fp16), to bf16
    through fp32: Triton's direct fp8e4nv -> bf16 takes the fp16 on to bf16 with one conversion
    instruction a value (`F2F.BF16.F16`, 384 a thread in a 64-position tile of the 8b decode kernel on
    sm_90, 192 in a 128 x 64 prefill tile, where the softmax has 102 `MUFU.EX2`), through fp32 with an
    fp16 -> fp32 add (`HADD2.F32`) a value and one bf16 pack (`F2FP`) per two; exact either way (every
    e4m3 value is an fp16, an fp32 and a bf16 one). To fp16 and fp32 the compiled code is the same as
    without the hop. Not timed yet.
    E4M3_BITS: the code's bits placed in an fp16 are the code's value / 2^8 exactly (see
    `dequantize_e4m3`); times 2^8 in fp16 is exact too (the largest, 448, is far below 65504).
    """
    if E4M3_UPCAST == "bits":  # E4M3_BITS
        bits = codes.to(tl.uint16)
        half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.float16, bitcast=True)
        values = (half * 256.0).to(DTYPE)
        values = tl.where((bits & 0x7F) == 0x7F, float("nan"), values)
    else:
        values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DTYPE)
        if E4M3_UPCAST == "cvt_interpreted":  # E4M3_CVT_INTERPRETED
            values = tl.where((codes & 0x7F) == 0x7F, float("nan"), values)
    return values


@triton.jit
def dequantize_e4m3(codes, scale, KV_DTYPE: tl.constexpr, E4M3_UPCAST: tl.constexpr):
    """e4m3 codes (uint8) -> (float32(code) * scale).to(KV_DTYPE); scale is fp32. 0x7F / 0xFF (NaN,
    never stored from a finite K/V) give NaN.

    E4M3_CVT: the codes bitcast to fp8e4nv and converted (exact). E4M3_BITS: the code's bits placed in an
    fp16 (sign to bit 15, exponent and mantissa shifted up by 7) are the code's value / 2^8 exactly,
    subnormals included (fp16 has 2 more exponent bits and 7 more mantissa bits), and (value / 2^8) *
    (scale * 2^8) rounds to the same fp32 as value * scale.
    """
    if E4M3_UPCAST == "bits":  # E4M3_BITS
        bits = codes.to(tl.uint16)
        half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.float16, bitcast=True)
        values = half.to(tl.float32) * (scale * 256.0)
        values = tl.where((bits & 0x7F) == 0x7F, float("nan"), values)
    else:
        values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        if E4M3_UPCAST == "cvt_interpreted":  # E4M3_CVT_INTERPRETED
            values = tl.where((codes & 0x7F) == 0x7F, float("nan"), values)
    return values.to(KV_DTYPE)


@triton.jit
def load_kv_tile(
    k_head_ptr,  # k_cache + kv_head * stride_k_head
    v_head_ptr,  # v_cache + kv_head * stride_v_head
    blocks,  # [N] int32: the block of each position (`tile_blocks`)
    positions,  # [N] context positions of the tile
    pos_mask,  # [N] which may be loaded (ignored unless MASKED)
    dims,  # [DIM_PAD]
    dim_mask,  # [DIM_PAD]
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    k_scale,  # FP8_KV only: `load_kv_scales`
    v_scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    FP8_KV: tl.constexpr,
    KV_DTYPE: tl.constexpr,  # FP8_KV only: the model dtype the tile is converted to
    E4M3_UPCAST: tl.constexpr,  # FP8_KV only: `e4m3_upcast`
    FOLD_KV_SCALES: tl.constexpr,  # FP8_KV only: the codes' values (True) or dequantized (False)
):
    """(K^T [DIM_PAD, N], V [N, DIM_PAD]) of the tile; masked-out positions and padded dims are 0. An FP8
    tile is in KV_DTYPE: the codes' values (FOLD_KV_SCALES) or code * scale rounded to KV_DTYPE."""
    if MASKED:
        kt_mask = dim_mask[:, None] & pos_mask[None, :]
        v_mask = pos_mask[:, None] & dim_mask[None, :]
    else:
        kt_mask = dim_mask[:, None]
        v_mask = dim_mask[None, :]
    blocks = blocks.to(tl.int64)  # block * stride_k_block can pass 2**31 in a large cache
    slots = positions % BLOCK_SIZE
    k_rows = k_head_ptr + blocks * stride_k_block + slots * stride_k_slot  # [N]
    v_rows = v_head_ptr + blocks * stride_v_block + slots * stride_v_slot
    if MASKED or HEAD_DIM != DIM_PAD:
        kt = tl.load(k_rows[None, :] + dims[:, None], mask=kt_mask, other=0.0)
        v = tl.load(v_rows[:, None] + dims[None, :], mask=v_mask, other=0.0)
    else:
        kt = tl.load(k_rows[None, :] + dims[:, None])
        v = tl.load(v_rows[:, None] + dims[None, :])
    if FP8_KV and FOLD_KV_SCALES:
        kt = upcast_e4m3(kt, KV_DTYPE, E4M3_UPCAST)
        v = upcast_e4m3(v, KV_DTYPE, E4M3_UPCAST)
    elif FP8_KV:
        kt = dequantize_e4m3(kt, k_scale, KV_DTYPE, E4M3_UPCAST)
        v = dequantize_e4m3(v, v_scale, KV_DTYPE, E4M3_UPCAST)
    return kt, v


@triton.jit
def tile_blocks(
    block_table_ptr, tile_start, lo, hi, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr
):
    """The block of each position of the tile at tile_start ([BLOCK_N] int32); with MASKED, 0 for the
    positions outside [lo, hi), whose block-table entries are not read."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    entries = block_table_ptr + positions // BLOCK_SIZE
    if MASKED:
        return tl.load(entries, mask=(positions >= lo) & (positions < hi), other=0)
    return tl.load(entries)


@triton.jit
def attend_paged_tile(
    q,  # [M, DIM_PAD] query rows (padded rows are 0), already in the dot's operand dtype
    running_max,  # [M] fp32, base 2
    running_sum,  # [M] fp32
    acc,  # [M, DIM_PAD] fp32
    k_head_ptr,
    v_head_ptr,
    blocks,  # [BLOCK_N] int32: each position's block (`tile_blocks`)
    tile_start,  # first context position of the tile
    kv_lo,  # positions in [kv_lo, kv_hi) may be loaded (MASKED only)
    kv_hi,
    query_positions,  # [M] each row's own position (CAUSAL only)
    sliding_window,  # W: a row at p sees p - W + 1 .. p (CAUSAL only)
    dims,
    dim_mask,
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    qk_scale,  # softmax scale * log2(e) (`fold_k_scale`: times k_scale with FOLD_KV_SCALES)
    k_scale,  # FP8_KV only: `load_kv_scales`
    v_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FP8_KV: tl.constexpr,
    KV_DTYPE: tl.constexpr,
    E4M3_UPCAST: tl.constexpr,
    FOLD_KV_SCALES: tl.constexpr,
):
    """Returns the updated (running_max, running_sum, acc); with FP8_KV and FOLD_KV_SCALES, acc is
    v_scale times too small (`unfold_v_scale`)."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    pos_mask = (positions >= kv_lo) & (positions < kv_hi)
    kt, v = load_kv_tile(
        k_head_ptr, v_head_ptr, blocks, positions, pos_mask, dims, dim_mask,
        stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, k_scale, v_scale,
        BLOCK_SIZE, HEAD_DIM, DIM_PAD, MASKED, FP8_KV, KV_DTYPE, E4M3_UPCAST, FOLD_KV_SCALES,
    )  # fmt: skip
    v_dtype = v.dtype  # the model dtype (an FP8 tile is converted to it)
    if UPCAST_DOT:
        kt = kt.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, kt, input_precision=DOT_PRECISION)  # [M, N], not yet scaled
    if MASKED:
        visible = pos_mask[None, :]
        if CAUSAL:
            visible = visible & (positions[None, :] <= query_positions[:, None])
            visible = visible & (positions[None, :] > query_positions[:, None] - sliding_window)
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row that has seen no position yet keeps -inf: exp2(-inf - 0) = 0 rather than NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.math.exp2(scores - safe_max[:, None])
    else:
        # Every score is finite here, so is the new maximum. The scale (> 0) is taken to the rows' maxima
        # and joins each score's subtraction as one FFMA (Triton's fused-attention tutorial's form): the
        # same values as scaling first, one float multiply a score fewer.
        safe_max = tl.maximum(running_max, tl.max(scores, axis=1) * qk_scale)
        new_max = safe_max
        probs = tl.math.exp2(scores * qk_scale - safe_max[:, None])
    alpha = tl.math.exp2(running_max - safe_max)
    running_sum = running_sum * alpha + tl.sum(probs, axis=1)
    probs = probs.to(v_dtype)  # P in V's dtype, as FlashAttention feeds the second GEMM
    if UPCAST_DOT:
        probs = probs.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(probs, v, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc


@triton.jit
def split_context(context_len, num_splits, PARTITION_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """(slice_len, slices): context_len positions cut into at most num_splits slices of whole TILE_N
    tiles, none shorter than PARTITION_SIZE unless the whole context is; slice i starts i * slice_len
    after the context's start. A context of 0 positions has 0 slices."""
    wanted = tl.minimum(tl.cdiv(context_len, PARTITION_SIZE), num_splits)
    # At least one tile, so that an empty context gets 0 slices, not 0 / 0.
    slice_len = tl.maximum(tl.cdiv(tl.cdiv(context_len, tl.maximum(wanted, 1)), TILE_N), 1) * TILE_N
    return slice_len, tl.cdiv(context_len, slice_len)


@triton.jit
def attend_paged_span(
    q,
    running_max,
    running_sum,
    acc,
    k_head_ptr,
    v_head_ptr,
    block_table_ptr,
    lo,  # first tile's start (a multiple of BLOCK_N at or below kv_lo)
    full_lo,  # [full_lo, full_hi): whole tiles every row sees wholly (multiples of BLOCK_N)
    full_hi,
    kv_lo,  # positions in [kv_lo, kv_hi) may be loaded; the span ends at kv_hi
    kv_hi,
    query_positions,
    sliding_window,
    dims,
    dim_mask,
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    qk_scale,
    k_scale,
    v_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FP8_KV: tl.constexpr,
    KV_DTYPE: tl.constexpr,
    E4M3_UPCAST: tl.constexpr,
    FOLD_KV_SCALES: tl.constexpr,
):
    """`attend_paged_tile` over every tile of [lo, kv_hi), in three loops: the masked tiles before
    full_lo (a window's first), the unmasked ones of [full_lo, full_hi), software-pipelined over
    NUM_STAGES, and the masked ones from full_hi (the diagonal, the context's partial last tile).

        lo      kv_lo   full_lo                 full_hi      kv_hi
        |-------+-------|=======================|------------+--|
         masked (lo..)    unmasked, NUM_STAGES    masked (..kv_hi)

    Returns the updated (running_max, running_sum, acc), as `attend_paged_tile` does."""
    for tile_start in tl.range(lo, full_lo, BLOCK_N):
        blocks = tile_blocks(block_table_ptr, tile_start, kv_lo, kv_hi, BLOCK_N, BLOCK_SIZE, True)
        running_max, running_sum, acc = attend_paged_tile(
            q, running_max, running_sum, acc, k_head_ptr, v_head_ptr, blocks, tile_start, kv_lo,
            kv_hi, query_positions, sliding_window, dims, dim_mask,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, qk_scale, k_scale, v_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, DIM_PAD, True, CAUSAL, DOT_PRECISION, UPCAST_DOT, FP8_KV,
            KV_DTYPE, E4M3_UPCAST, FOLD_KV_SCALES,
        )  # fmt: skip
    # PREFETCH_BLOCKS: each tile's block-table entries are loaded one tile ahead and carried into the next
    # iteration, so the addresses of the K/V copies the software pipeline issues need no load of that
    # iteration: Triton then keeps the next tile's copies in flight through this tile's compute. With the
    # entries loaded in the tile, a tile's copies are issued at the end of the iteration before and waited
    # for, with the next tile's entries, at the top of its own: they overlap only the previous tile's P.V
    # product (the sm_90 TTGIR: `ttg.async_wait {num = 0}` against `{num = 2}`).
    if PREFETCH_BLOCKS:
        next_blocks = tile_blocks(block_table_ptr, full_lo, full_lo, full_hi, BLOCK_N, BLOCK_SIZE, True)
    for tile_start in tl.range(full_lo, full_hi, BLOCK_N, num_stages=NUM_STAGES):
        if PREFETCH_BLOCKS:
            blocks = next_blocks
            next_blocks = tile_blocks(
                block_table_ptr, tile_start + BLOCK_N, full_lo, full_hi, BLOCK_N, BLOCK_SIZE, True
            )
        else:
            blocks = tile_blocks(block_table_ptr, tile_start, full_lo, full_hi, BLOCK_N, BLOCK_SIZE, False)
        running_max, running_sum, acc = attend_paged_tile(
            q, running_max, running_sum, acc, k_head_ptr, v_head_ptr, blocks, tile_start, kv_lo,
            kv_hi, query_positions, sliding_window, dims, dim_mask,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, qk_scale, k_scale, v_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, DIM_PAD, False, CAUSAL, DOT_PRECISION, UPCAST_DOT, FP8_KV,
            KV_DTYPE, E4M3_UPCAST, FOLD_KV_SCALES,
        )  # fmt: skip
    for tile_start in tl.range(full_hi, kv_hi, BLOCK_N):
        blocks = tile_blocks(block_table_ptr, tile_start, kv_lo, kv_hi, BLOCK_N, BLOCK_SIZE, True)
        running_max, running_sum, acc = attend_paged_tile(
            q, running_max, running_sum, acc, k_head_ptr, v_head_ptr, blocks, tile_start, kv_lo,
            kv_hi, query_positions, sliding_window, dims, dim_mask,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, qk_scale, k_scale, v_scale,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, DIM_PAD, True, CAUSAL, DOT_PRECISION, UPCAST_DOT, FP8_KV,
            KV_DTYPE, E4M3_UPCAST, FOLD_KV_SCALES,
        )  # fmt: skip
    return running_max, running_sum, acc
