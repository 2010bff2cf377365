"""Decode attention over the paged KV cache: one query token per sequence, split along the context.

Flash-decoding in two kernels:

    split kernel    grid (num_seqs, num_kv_heads, num_splits)
        each program takes the QUERIES_PER_KV query heads sharing one KV head (GQA: one K/V load serves
        the group) and one slice of the sequence's context, and writes that slice's normalized output
        and log-sum-exp (fp32, base 2) for each head.
    reduce kernel   grid (num_seqs, num_heads)
        merges the slices:  LSE = log2(sum_p 2^lse_p);  out = sum_p 2^(lse_p - LSE) * out_p

With `DecodeConfig.fused_reduce` (off until a GPU times it) there is no reduce launch: each slice counts
itself in on its (sequence, KV head)'s counter once its partials are stored, and the last to count merges
the group's heads with the reduce kernel's code (`_merge_slices`), then puts the counter back to 0: split-K's
fused reduce (`sluice.kernels.split_k`, whose counters it shares; one launch at a time uses them). A batch-1
step saves a launch per layer where the context is split (run 15: a 512-token graph step as fast at
128-position partitions, four slices and the reduce, as at 512, one slice and none).

`num_splits` is fixed per launch (`pick_num_splits`: enough programs for every SM when batch x KV heads
alone is too few), and each sequence divides *its own* context among at most that many slices, none
shorter than `partition_size` positions (rounded up to whole tiles) unless the context is:

    ctx_lo = window start rounded down to a tile;  L = seq_len - ctx_lo
    splits_s = min(num_splits, cdiv(L, partition_size));  slice = cdiv(L, splits_s) rounded up to TILE_N
    slice i covers [ctx_lo + i * slice, min(ctx_lo + (i + 1) * slice, seq_len))  for i < cdiv(L, slice)

The grid and the partial buffers depend only on (num_seqs, num_kv_heads, max_seq_len) and the device, so a
CUDA graph captured with max_seq_len = the largest context it may see replays any shorter contexts
correctly; the partials never exceed cdiv(max_seq_len, partition_size) slices per head (the bound
`cuda_graph_runner.estimate_graph_memory_bytes` assumes). With num_splits == 1 the split kernel writes
the output itself and no reduce runs. A sequence with no context (seq_len 0, a padding row) gets 0.

With a sliding window W only positions seq_len - W .. seq_len - 1 are read (earlier blocks may be freed).
An FP8 cache (float8_e4m3fn, with kv_scales) is read as its codes, converted tile by tile in registers
(`paged_attention_tile`: the GPU's e4m3 conversion on sm_89+), with the scales folded into the scores'
scale and each slice's output (FOLD_KV_SCALES) or applied to every value; the scales are read on the
device, so a captured graph stays valid.
Tile sizes and num_warps / num_stages (`decode_config`) were swept on an H100 (run 2: 64 positions best at
4k x 32, 128 faster at 32k x 8) and, on the kernel as it is now, on an H200 (run 12: 128 positions faster
at both, 1.14x and 1.40x; docs/perf/README.md), whose choice the bf16 / fp16 cache takes. An FP8 cache
keeps 64 (run 15: served, 128 made its launches 1.8x slower).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sluice.kernels.compile_target import device_sm_count
from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.paged_attention_tile import (
    LOG2_E,
    attend_paged_span,
    dot_settings,
    e4m3_upcast,
    fold_k_scale,
    folds_kv_scales,
    load_kv_scales,
    split_context,
    unfold_v_scale,
)
from sluice.kernels.split_k import split_counters
from sluice.kernels.store_kv import kernel_kv_cache
from sluice.kernels.tensor_checks import (
    KVScales,
    check_block_tables,
    check_power_of_two,
    check_q_and_kv_cache,
    check_scale_and_window,
    check_shape,
    check_tensor,
    output_like,
)

# The shortest slice a program takes (unless the whole context is shorter). It sets how many of a graph's
# splits (sized for its longest context) a short context uses: run 15 (H200) timed the llama-3.2-1b batch-1
# graph step for 8192 positions 1.07x faster at 128 than at 512, the one for 512 positions the same.
DEFAULT_PARTITION_SIZE = 128
MAX_SPLITS = 64  # the most slices per (sequence, KV head); bounds the reduce kernel's tile
PROGRAMS_PER_SM = 2  # split until batch x KV heads x splits fills every SM this many times (untuned)
_MIN_DOT_ROWS = 16  # tl.dot needs every dim >= 16 on GPUs
_PARTITION_MULTIPLE = 16
NO_WINDOW = 2**31 - 1  # sliding_window passed to the kernels for full attention


@dataclass(frozen=True)
class DecodeConfig:
    """The split kernel's tile: tile_n positions per step."""

    tile_n: int
    num_warps: int
    num_stages: int
    # Load each KV tile's block-table entries one tile ahead (`attend_paged_span`'s PREFETCH_BLOCKS).
    prefetch_blocks: bool = False
    # The last slice of each (sequence, KV head) to finish merges the slices itself (FUSED_REDUCE), in place
    # of the reduce launch: one launch a step fewer. Off until a GPU times it (docs/GPU.md, call 1).
    fused_reduce: bool = False

    def __post_init__(self) -> None:
        check_power_of_two("config.tile_n", self.tile_n, 16)
        if self.num_warps <= 0 or self.num_stages <= 0:
            raise ValueError(f"config: num_warps and num_stages must be > 0, got {self}")


def decode_config(head_dim: int, dtype: torch.dtype, fp8_kv: bool = False) -> DecodeConfig:
    """128-position tiles (32 KiB of K per step at head_dim 128 in bf16), 4 warps, 3 stages; 32 positions
    and 2 stages when an element of q is 4 bytes or head_dim > 128. The H200's sweep (run 12,
    docs/perf/gpu_check_h200_2026-11-29_run12.md; head_dim 128, a bf16 cache) timed 128 positions 1.14x and
    1.40x faster than 64 at 4k x 32 and 32k x 8 (0.90 and 0.89 of the copy bandwidth); on an H100 with the
    kernel of run 2 they were slower at 4k x 32 (0.74x) and faster at 32k x 8 (1.06-1.25x).

    An FP8 cache (`fp8_kv`) keeps 64 positions. Served on llama-3-8b's shape (contexts of 128-256), its
    decode launches took 27 / 48 us at 1 / 64 rows with 128-position tiles (run 15) against 15 / 27-29 us
    with 64 (runs 13-14; another H200 each), where the bf16 cache's moved by +22% / +4%: a tile's V codes
    are read from shared memory a byte at a time (`LDS.U8`, docs/perf/kernels_sm90.md), twice as many a
    thread at 128. Its long-context kernel rows were 11-18% faster at 128 (run 15 against run 12)."""
    if dtype == torch.float32 or head_dim > 128:
        return DecodeConfig(tile_n=32, num_warps=4, num_stages=2)
    if fp8_kv:
        return DecodeConfig(tile_n=64, num_warps=4, num_stages=3)
    return DecodeConfig(tile_n=128, num_warps=4, num_stages=3)


def pick_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    num_sms: int,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    max_splits: int = MAX_SPLITS,
    programs_per_sm: int = PROGRAMS_PER_SM,
) -> int:
    """Slices per (sequence, KV head) for a decode launch (per (q tile, KV head) for a prefill one:
    `num_seqs` counts the launch's units of work per KV head): the fewest that give every SM
    `programs_per_sm` programs, but no more than the longest context has `partition_size` slices
    (a short context is not worth splitting) and no more than `max_splits`. Always >= 1."""
    checked = (
        ("num_sms", num_sms),
        ("partition_size", partition_size),
        ("max_splits", max_splits),
        ("programs_per_sm", programs_per_sm),
    )
    for name, value in checked:
        if value <= 0:
            raise ValueError(f"{name}: must be > 0, got {value}")
    units = num_seqs * num_kv_heads
    if units <= 0 or max_context <= 0:
        return 1
    wanted = -(-programs_per_sm * num_sms // units)
    by_length = -(-max_context // partition_size)
    return max(1, min(wanted, by_length, max_splits))


@triton.jit
def _sequence_slices(seq_len, sliding_window, num_splits, PARTITION_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """(window_start, ctx_lo, slice_len, slices) of one sequence; both kernels derive them alike."""
    window_start = tl.maximum(seq_len - sliding_window, 0)
    ctx_lo = window_start // TILE_N * TILE_N
    slice_len, slices = split_context(seq_len - ctx_lo, num_splits, PARTITION_SIZE, TILE_N)
    return window_start, ctx_lo, slice_len, slices


# Not specialized (see prefill_attention): the split count and block-table width change from step to step.
@triton.jit(do_not_specialize=["sliding_window", "num_splits", "stride_bt_seq"])
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,  # [num_seqs, num_heads, head_dim]: written only when SINGLE_SPLIT or FUSED_REDUCE
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, base 2
    counter_ptr,  # FUSED_REDUCE only: [num_seqs * num_kv_heads] int32 zeros, left zero
    k_scale_ptr,  # FP8_KV only: [] fp32
    v_scale_ptr,
    qk_scale,
    sliding_window,
    num_splits,
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    num_heads,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH_BLOCKS: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FP8_KV: tl.constexpr,
    E4M3_UPCAST: tl.constexpr,
    FOLD_KV_SCALES: tl.constexpr,
    FUSED_REDUCE: tl.constexpr = False,
    SPLITS_PAD: tl.constexpr = 1,  # FUSED_REDUCE: next_power_of_2(num_splits)
    PDL: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    wait_prior_kernel(PDL)
    seq_len = tl.load(seq_lens_ptr + seq)
    window_start, ctx_lo, slice_len, slices = _sequence_slices(
        seq_len, sliding_window, num_splits, PARTITION_SIZE, TILE_N
    )
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * QUERIES_PER_KV + groups
    group_mask = groups < QUERIES_PER_KV
    dim_mask = dims < HEAD_DIM
    q_mask = group_mask[:, None] & dim_mask[None, :]
    if split >= slices:
        if (SINGLE_SPLIT or FUSED_REDUCE) and split == 0:  # no context at all: the output is defined as 0
            zeros = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32).to(out_ptr.dtype.element_ty)
            o_offsets = seq * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :]
            tl.store(out_ptr + o_offsets, zeros, mask=q_mask)
        return
    lo = ctx_lo + split * slice_len
    hi = tl.minimum(lo + slice_len, seq_len)
    # Whole tiles inside [window_start, hi) need no mask; the window's first tile and the last,
    # partial tile do.
    full_lo = tl.minimum(tl.maximum(lo, tl.cdiv(window_start, TILE_N) * TILE_N), hi)
    full_hi = tl.maximum(hi // TILE_N * TILE_N, full_lo)

    # q: [GROUP_PAD, DIM_PAD]; padded rows are 0 and never stored.
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :], mask=q_mask, other=0.0
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)
    k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, FP8_KV)
    qk_scale = fold_k_scale(qk_scale, k_scale, FP8_KV, FOLD_KV_SCALES)
    kv_dtype = q_ptr.dtype.element_ty
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_k_head
    v_head_ptr = v_cache_ptr + kv_head * stride_v_head
    table_ptr = block_tables_ptr + seq * stride_bt_seq
    running_max, running_sum, acc = attend_paged_span(
        q, running_max, running_sum, acc, k_head_ptr, v_head_ptr, table_ptr, lo, full_lo, full_hi,
        window_start, hi, running_max, sliding_window, dims, dim_mask,
        stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, qk_scale, k_scale, v_scale,
        TILE_N, BLOCK_SIZE, HEAD_DIM, DIM_PAD, False, NUM_STAGES, PREFETCH_BLOCKS, DOT_PRECISION, UPCAST_DOT,
        FP8_KV, kv_dtype, E4M3_UPCAST, FOLD_KV_SCALES,
    )  # fmt: skip

    # Every slice holds at least one visible position, so running_sum > 0.
    out = unfold_v_scale(acc, v_scale, FP8_KV, FOLD_KV_SCALES) / running_sum[:, None]
    if SINGLE_SPLIT:
        o_offsets = seq * stride_o_seq + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        stat_offsets = (seq * num_heads + heads) * num_splits + split
        tl.store(part_lse_ptr + stat_offsets, running_max + tl.math.log2(running_sum), mask=group_mask)
        tl.store(part_out_ptr + stat_offsets[:, None] * HEAD_DIM + dims[None, :], out, mask=q_mask)
        if FUSED_REDUCE:
            tl.debug_barrier()  # every thread's partials are stored before the count releases them
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == slices - 1:  # the last slice
                for group in range(QUERIES_PER_KV):
                    head = kv_head * QUERIES_PER_KV + group
                    _merge_slices(
                        out_ptr, part_out_ptr, part_lse_ptr, seq, head, slices, num_splits, stride_o_seq,
                        stride_o_head, num_heads, HEAD_DIM, DIM_PAD, SPLITS_PAD,
                    )  # fmt: skip
                tl.store(counter, 0)


@triton.jit
def _merge_slices(
    out_ptr, part_out_ptr, part_lse_ptr, seq, head, slices, num_splits, stride_o_seq, stride_o_head,
    num_heads, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    """out[seq, head] from its `slices` partial outputs and LSEs: LSE = log2(sum_p 2^lse_p), out =
    sum_p 2^(lse_p - LSE) * out_p; 0 for a sequence with no slices. The reduce kernel's, and with
    FUSED_REDUCE the last slice's."""
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    split_mask = splits < slices
    stat_offsets = (seq * num_heads + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + stat_offsets, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(slices > 0, lse_max, 0.0)
    weights = tl.where(split_mask, tl.math.exp2(lse - lse_max), 0.0)
    total = tl.sum(weights, axis=0)
    # A sequence with no context (seq_len 0, e.g. a padding row) has no slices: output 0.
    total = tl.where(total > 0.0, total, 1.0)
    part_out = tl.load(
        part_out_ptr + stat_offsets[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(part_out * weights[:, None], axis=0) / total
    out_ptrs = out_ptr + seq * stride_o_seq + head * stride_o_head + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit(do_not_specialize=["sliding_window", "num_splits"])
def _decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    sliding_window,
    num_splits,
    stride_o_seq,
    stride_o_head,
    num_heads,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    wait_prior_kernel(PDL)
    seq_len = tl.load(seq_lens_ptr + seq)
    _, _, _, slices = _sequence_slices(seq_len, sliding_window, num_splits, PARTITION_SIZE, TILE_N)
    _merge_slices(
        out_ptr, part_out_ptr, part_lse_ptr, seq, head, slices, num_splits, stride_o_seq, stride_o_head,
        num_heads, HEAD_DIM, DIM_PAD, SPLITS_PAD,
    )  # fmt: skip


def _check_decode_args(
    q, k_cache, v_cache, block_tables, seq_lens, scale, partition_size, sliding_window, kv_scales
) -> None:
    check_q_and_kv_cache(q, k_cache, v_cache, kv_scales)
    num_seqs = q.shape[0]
    check_block_tables(block_tables, num_seqs, q.device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=q.device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    if partition_size <= 0 or partition_size % _PARTITION_MULTIPLE:
        raise ValueError(
            f"partition_size: {partition_size} must be a positive multiple of {_PARTITION_MULTIPLE}"
        )
    check_scale_and_window(scale, sliding_window)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    kv_scales: KVScales | None = None,
    fold_kv_scales: bool | None = None,
) -> torch.Tensor:
    """Attention of q [num_seqs, num_heads, head_dim] (one new token per sequence) over each
    sequence's first seq_lens[s] cached positions. Returns [num_seqs, num_heads, head_dim] in q's dtype.

    `max_seq_len` bounds every seq_lens entry and, with the batch and the SM count, sets the split count
    (`pick_num_splits`); under CUDA graphs pass the largest context the graph may see (the grid is frozen at
    capture). `partition_size`: the shortest slice one program takes. `num_splits` overrides the pick (tests;
    capped at `MAX_SPLITS`), `config` the tile (`decode_config`, by q's dtype and the cache's). `out`, when
    given, receives the result (same shape and dtype as q). `sliding_window` W: attend to the last W positions
    only (block-table entries before them are never read). An FP8 cache (float8_e4m3fn) takes kv_scales
    (k_scale, v_scale), float32 one-element tensors: K = float32(code) * k_scale. `fold_kv_scales` (None:
    `DEFAULT_FOLD_KV_SCALES`) picks how (`paged_attention_tile`): True scales the scores and the output, False
    rounds each K/V value to q's dtype, as `dequantize_kv` does; equal with unit scales.
    """
    _check_decode_args(
        q, k_cache, v_cache, block_tables, seq_lens, scale, partition_size, sliding_window, kv_scales
    )
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: must be in 1..{MAX_SPLITS}, got {num_splits}")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = output_like("out", out, q)
    if num_seqs == 0:
        return out
    config = config or decode_config(head_dim, q.dtype, fp8_kv=kv_scales is not None)
    if num_splits is None:
        context = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + config.tile_n)
        num_splits = pick_num_splits(
            num_seqs, num_kv_heads, context, device_sm_count(q.device), partition_size
        )
    single = num_splits == 1
    counters = (
        None if single or not config.fused_reduce else split_counters(q.device, num_seqs * num_kv_heads)
    )
    part_out = part_lse = None  # one split writes `out` itself: no partials, nothing allocated
    if not single:
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_out = part_lse.new_empty(*part_lse.shape, head_dim)
    queries_per_kv = num_heads // num_kv_heads
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    window = sliding_window or NO_WINDOW
    precision, upcast = dot_settings(q.dtype)
    k_cache, v_cache, k_scale, v_scale = kernel_kv_cache(k_cache, v_cache, kv_scales)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, counters, k_scale, v_scale,
        scale * LOG2_E, window, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), num_heads,
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PAD=max(_MIN_DOT_ROWS, triton.next_power_of_2(queries_per_kv)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=k_cache.shape[1],
        TILE_N=config.tile_n,
        PARTITION_SIZE=partition_size,
        NUM_STAGES=config.num_stages,
        PREFETCH_BLOCKS=config.prefetch_blocks,
        SINGLE_SPLIT=single,
        DOT_PRECISION=precision,
        UPCAST_DOT=upcast,
        FP8_KV=k_scale is not None,
        E4M3_UPCAST=e4m3_upcast(q.device),
        FOLD_KV_SCALES=folds_kv_scales(k_scale is not None, fold_kv_scales),
        FUSED_REDUCE=counters is not None,
        SPLITS_PAD=triton.next_power_of_2(num_splits) if counters is not None else 1,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch_options(q.device),
    )  # fmt: skip
    if not single and counters is None:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, seq_lens, window, num_splits,
            out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            TILE_N=config.tile_n,
            PARTITION_SIZE=partition_size,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            **pdl_launch_options(q.device),
        )  # fmt: skip
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """Plain PyTorch version of `paged_decode_attention`: gather each context (an FP8 one dequantized to
    q's dtype), softmax in fp32."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(max(seq_len - (sliding_window or seq_len), 0), seq_len, device=q.device)
        blocks = block_tables[s, positions // block_size].long()
        k, v = gather_kv_reference(k_cache, v_cache, blocks, positions % block_size, kv_scales, q.dtype)
        k, v = k.float(), v.float()  # [num_positions, num_kv_heads, head_dim]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[s].float(), k) * scale
        out[s] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def gather_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    kv_scales: KVScales | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' K, V at (blocks, offsets): as stored, or an FP8 cache's codes * scale in `dtype`."""
    k, v = k_cache[blocks, offsets], v_cache[blocks, offsets]
    if kv_scales is None:
        return k, v
    return (k.float() * kv_scales[0]).to(dtype), (v.float() * kv_scales[1]).to(dtype)
