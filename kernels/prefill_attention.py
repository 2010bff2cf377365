"""Variable-length causal attention over the paged KV cache (prefill chunks, prefix-cache hits, decodes).

Queries of many sequences are concatenated; sequence s owns rows query_start_loc[s] : query_start_loc[s+1].
Its K/V (cached prefix and this step's tokens, already written by `store_kv`) are read from the cache:

    context positions   0 ........ prefix_len-1 | prefix_len ........ seq_len-1
                        cached by earlier steps  | new tokens = this step's query rows
    query row j sits at position prefix_len + j and sees positions <= its own
    (and, with a sliding window W, > its own - W).

FlashAttention-2 over a paged cache, with the GQA group packed into the tile's rows:

    a program per (q tile, KV head); a q tile is BLOCK_Q = BLOCK_M // QUERIES_PER_KV tokens of one
    sequence times the QUERIES_PER_KV query heads of one KV head:
        tile row r  ->  token r // QUERIES_PER_KV, query head kv_head * QUERIES_PER_KV + r % QUERIES_PER_KV
    so every K/V tile loaded from the cache serves the whole group (one load instead of QUERIES_PER_KV).
    Sequence s's tiles are numbered from query_start_loc[s] // BLOCK_Q + s (a binary search finds s), so
    num_q_tiles = num_tokens // BLOCK_Q + num_seqs covers any ragged batch; programs run the
    numbering backwards so the longest causal tiles start first, every KV head's before the next tile's
    (`PrefillConfig.interleave_heads`):

        program    0      1    ...  H-1      H      H+1  ...          H = num_kv_heads, T = num_q_tiles
        tile     T-1    T-1    ...  T-1    T-2    T-2    ...
        KV head    0      1    ...  H-1      0      1    ...

    The GPU starts programs in this order, so the last to start are the shortest. With a head's tiles all
    launched before the next head's (interleave_heads False), the longest tiles of the last heads start
    last: in a model of the launch (docs/perf/README.md), a 2k prompt of llama-3.2-1b's shape takes 1.48x
    the ideal time that way against 1.00x interleaved, 4k 1.2x, 8k the same; not timed on a GPU yet.

Each program walks its context in BLOCK_N-position tiles in three runs (`attend_paged_span`, shared with
the decode kernel; the unmasked run software-pipelined by `tl.range`, each tile's block-table entries
loaded one tile ahead (`PrefillConfig.prefetch_blocks`) so that the pipeline keeps the next tile's K/V
copies in flight while this tile computes):

    [lo, full_lo)        masked: the window's lower edge (positions some rows may not see)
    [full_lo, full_hi)   unmasked: every row sees every position (no masks, the bulk of the work)
    [full_hi, kv_end)    masked: the causal diagonal
    lo = the first row's window start (tiles wholly before it, possibly freed blocks, are never read),
    kv_end = the last row's position + 1 (tiles past the diagonal are skipped).

Split-KV (flash-decoding's split, for prefill tiles): a query of a few tiles after a long cached prefix (a
prefix-cache hit on a long document, a speculative verify, a decode row beside a longer query) is few
programs, each walking the whole prefix while most SMs idle. Given the context bound `max_seq_len`, the
launcher picks num_splits (`pick_prefill_splits`: enough programs to fill every SM twice when the q tiles x KV
heads are too few for 0.8 of the SMs; slices of >= `partition_size` positions) and the grid gets a dimension
of splits: each program takes one slice of its tile's context [lo, kv_end) (`split_context`, whole BLOCK_N
tiles), its three runs clipped to the slice, and writes the slice's normalized output and log-sum-exp per row;
`merge_attention_partials` combines them. A tile with fewer slices than the grid (a shorter context) marks its
extra programs' rows empty (lse -inf). num_splits 1 is the kernel as before, writing the output itself.

An FP8 cache (float8_e4m3fn, with kv_scales) is read as its codes and converted tile by tile in
registers to q's dtype (`paged_attention_tile`: the GPU's e4m3 conversion on sm_89+), its scales folded
into the scores' scale and the output (FOLD_KV_SCALES) or applied to every value; everything after the
load is the same.

Tile shapes and num_warps / num_stages come from `prefill_config`, a small table: its sm_90 entries follow
the shapes of Triton's fused-attention tutorial, and a sweep on an H100 (docs/perf/README.md) found no
candidate more than 4% faster at 2k or 8k (noise), so they stay.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.merge_attention_partials import merge_attention_partials
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
from sluice.kernels.paged_decode_attention import (
    MAX_SPLITS,
    NO_WINDOW,
    gather_kv_reference,
)
from sluice.kernels.prefill_splits import PREFILL_PARTITION_SIZE, pick_prefill_splits
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


@dataclass(frozen=True)
class PrefillConfig:
    """One launch's tile shape: block_m rows (tokens x group heads) against block_n positions."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Load each KV tile's block-table entries one tile ahead (`attend_paged_span`'s PREFETCH_BLOCKS).
    prefetch_blocks: bool = True
    # Launch every KV head's program of a q tile before the next tile's (longest tiles first across heads).
    interleave_heads: bool = True

    def __post_init__(self) -> None:
        check_power_of_two("config.block_m", self.block_m, 16)
        check_power_of_two("config.block_n", self.block_n, 16)
        if self.num_warps <= 0 or self.num_stages <= 0:
            raise ValueError(f"config: num_warps and num_stages must be > 0, got {self}")


def prefill_config(
    head_dim: int, dtype: torch.dtype, queries_per_kv: int, max_query_len: int
) -> PrefillConfig:
    """The tile shape for a launch (untuned table; sm_90 numbers await a GPU run).

    bf16/fp16 with head_dim <= 128: 128 x 64 tiles, 8 warps (two warpgroups of 64 rows; with 4 warps the
    head_dim 64 tile needs ~254 registers a thread), 3 stages, the block-table entries one tile ahead
    (`prefetch_blocks`); head_dim > 128: 64 x 32, 4 warps, 2 stages; fp32 (twice the bytes, FMA dots):
    64 x 32, 8 warps, 2 stages (both without `prefetch_blocks`: with it, the fp32 variants compiled for
    sm_90 took 246-255 registers a thread instead of 110-214). A batch of short queries (decode rows, small
    chunks) shrinks block_m to what one sequence's group fills, and block_m never drops below the group
    size (one token's heads share a tile).
    """
    if dtype == torch.float32:  # exact fp32 dots run on FMA units and need many registers: 8 warps
        config = PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2, prefetch_blocks=False)
    elif head_dim > 128:
        config = PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, prefetch_blocks=False)
    else:
        config = PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    rows_needed = max(16, triton.next_power_of_2(max(1, max_query_len) * queries_per_kv))
    group_rows = max(16, triton.next_power_of_2(queries_per_kv))
    block_m = max(group_rows, min(config.block_m, rows_needed))
    if block_m != config.block_m:
        config = replace(config, block_m=block_m, num_warps=min(config.num_warps, 4))
    return config


@triton.jit
def _find_sequence(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence s whose tiles [query_start_loc[s] // BLOCK_Q + s, ...) contain `tile_id`."""
    left: tl.int32 = 0
    right: tl.int32 = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            left = mid + 1
        else:
            right = mid
    return left - 1


# Integers that change from step to step are not specialized: Triton would otherwise compile a variant per
# value class (== 1, divisible by 16) of the batch size, tile count and block-table width, and a serving
# step would stall on the JIT whenever a batch hit a new class.
@triton.jit(do_not_specialize=["sliding_window", "num_seqs", "num_q_tiles", "num_splits", "stride_bt_seq"])
def _prefill_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]: written only when SINGLE_SPLIT
    part_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] fp32 (`merge_attention_partials`)
    part_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32, base 2
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,  # FP8_KV only: [] fp32
    v_scale_ptr,
    qk_scale,
    sliding_window,
    num_seqs,
    num_q_tiles,
    num_splits,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    NUM_KV_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH_BLOCKS: tl.constexpr,
    INTERLEAVE_HEADS: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FP8_KV: tl.constexpr,
    E4M3_UPCAST: tl.constexpr,
    FOLD_KV_SCALES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if INTERLEAVE_HEADS:  # grid (num_q_tiles * num_kv_heads, num_splits)
        tile_id = num_q_tiles - 1 - tl.program_id(0) // NUM_KV_HEADS
        kv_head = tl.program_id(0) % NUM_KV_HEADS
        split = tl.program_id(1)
    else:  # grid (num_q_tiles, num_kv_heads, num_splits)
        tile_id = num_q_tiles - 1 - tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
    wait_prior_kernel(PDL)
    seq = _find_sequence(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    q_tile = tile_id - (query_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    tokens = q_tile * BLOCK_Q + rows // QUERIES_PER_KV  # token index within the sequence's query
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_mask = (rows < BLOCK_Q * QUERIES_PER_KV) & (tokens < query_len)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    row_tokens = (query_start + tokens).to(tl.int64)  # token * stride can pass 2**31 in a long batch
    q_offsets = row_tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    query_positions = prefix_len + tokens

    first_position = prefix_len + q_tile * BLOCK_Q
    last_position = prefix_len + tl.minimum((q_tile + 1) * BLOCK_Q, query_len) - 1
    kv_end = last_position + 1
    kv_start = tl.maximum(first_position - sliding_window + 1, 0)
    lo = kv_start // BLOCK_N * BLOCK_N
    # Positions >= last_position - W + 1 are inside every row's window; <= first_position, causally
    # visible to every row. Tiles wholly between the two need no mask.
    all_windows_start = tl.maximum(last_position - sliding_window + 1, 0)
    full_lo = tl.minimum(tl.cdiv(all_windows_start, BLOCK_N) * BLOCK_N, kv_end)
    full_hi = tl.maximum((first_position + 1) // BLOCK_N * BLOCK_N, full_lo)
    if not SINGLE_SPLIT:
        # This program's slice of the tile's context [lo, kv_end); the three runs clipped to it.
        slice_len, slices = split_context(kv_end - lo, num_splits, PARTITION_SIZE, BLOCK_N)
        lo = lo + split * slice_len
        kv_end = tl.minimum(lo + slice_len, kv_end)
        full_lo = tl.minimum(tl.maximum(full_lo, lo), kv_end)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), kv_end)
        stat_offsets = (row_tokens * (NUM_KV_HEADS * QUERIES_PER_KV) + heads) * num_splits + split
        if split >= slices:  # the tile's context has fewer slices than the grid: this one is empty
            nothing = tl.full([BLOCK_M], float("-inf"), tl.float32)
            tl.store(part_lse_ptr + stat_offsets, nothing, mask=row_mask)
            return

    k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, FP8_KV)
    qk_scale = fold_k_scale(qk_scale, k_scale, FP8_KV, FOLD_KV_SCALES)
    kv_dtype = q_ptr.dtype.element_ty
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_k_head
    v_head_ptr = v_cache_ptr + kv_head * stride_v_head
    table_ptr = block_tables_ptr + seq * stride_bt_seq
    running_max, running_sum, acc = attend_paged_span(
        q, running_max, running_sum, acc, k_head_ptr, v_head_ptr, table_ptr, lo, full_lo, full_hi,
        kv_start, kv_end, query_positions, sliding_window, dims, dim_mask,
        stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, qk_scale, k_scale, v_scale,
        BLOCK_N, BLOCK_SIZE, HEAD_DIM, DIM_PAD, True, NUM_STAGES, PREFETCH_BLOCKS, DOT_PRECISION, UPCAST_DOT,
        FP8_KV, kv_dtype, E4M3_UPCAST, FOLD_KV_SCALES,
    )  # fmt: skip

    # Every real row sees at least its own position, so running_sum > 0 there; padded rows are not stored.
    # In a slice a row may see nothing (its causal limit is before the slice, its window after): its
    # lse is -inf and its output 0, which the merge weighs 0.
    acc = unfold_v_scale(acc, v_scale, FP8_KV, FOLD_KV_SCALES)
    out = acc / tl.where(running_sum > 0.0, running_sum, 1.0)[:, None]
    if SINGLE_SPLIT:
        o_offsets = row_tokens[:, None] * stride_o_token + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # running_max is -inf where running_sum is 0: lse -inf without taking log2(0).
        lse = running_max + tl.math.log2(tl.where(running_sum > 0.0, running_sum, 1.0))
        tl.store(part_lse_ptr + stat_offsets, lse, mask=row_mask)
        tl.store(part_out_ptr + stat_offsets[:, None] * HEAD_DIM + dims[None, :], out, mask=io_mask)


def _check_prefill_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, kv_scales) -> None:
    check_q_and_kv_cache(q, k_cache, v_cache, kv_scales)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=q.device)
    num_seqs = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=q.device)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_block_tables(block_tables, num_seqs, q.device)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    config: PrefillConfig | None = None,
    kv_scales: KVScales | None = None,
    fold_kv_scales: bool | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    partition_size: int = PREFILL_PARTITION_SIZE,
) -> torch.Tensor:
    """Causal attention of q [num_tokens, num_heads, head_dim] over the paged cache.

    query_start_loc [num_seqs + 1] int32, seq_lens [num_seqs] int32, block_tables [num_seqs, max_blocks]
    int32; `max_query_len` >= every query length (picks the tile shape). Returns [num_tokens, num_heads,
    head_dim] (written into `out` when given). `sliding_window` W: each query sees the last W positions up
    to its own. `config` overrides the tile shape of `prefill_config` (tests use small tiles). An FP8
    cache (float8_e4m3fn) takes kv_scales (k_scale, v_scale), float32 one-element tensors;
    `fold_kv_scales` picks how they are applied (`paged_decode_attention`).

    Split-KV: given `max_seq_len` (>= every seq_lens entry), a launch with too few q tiles x KV heads for
    the GPU splits each tile's context into slices of >= `partition_size` positions
    (`pick_prefill_splits`) and merges them after (`merge_attention_partials`); `num_splits` overrides
    the pick (1..MAX_SPLITS). Like the decode kernel's, the grid and partials depend only on the batch's
    shape and max_seq_len, so a CUDA graph captured with the largest context replays shorter ones.
    """
    _check_prefill_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, kv_scales)
    check_scale_and_window(scale, sliding_window)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    out = output_like("out", out, q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    config = config or prefill_config(head_dim, q.dtype, queries_per_kv, max_query_len)
    if config.block_m < queries_per_kv:
        raise ValueError(
            f"config.block_m: {config.block_m} rows cannot hold the {queries_per_kv} heads of a group"
        )
    if partition_size <= 0:
        raise ValueError(f"partition_size: must be > 0, got {partition_size}")
    block_q = config.block_m // queries_per_kv
    num_q_tiles = num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = pick_prefill_splits(
            num_tokens, num_seqs, max_query_len, num_kv_heads, block_q, config.block_n, max_seq_len,
            sliding_window, partition_size, q.device,
        )  # fmt: skip
    elif not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: must be in 1..{MAX_SPLITS}, got {num_splits}")
    single = num_splits == 1
    # One split writes `out` itself: no partials (None, as the unused FP8 scales), nothing allocated.
    part_out, part_lse = (None, None) if single else _split_partials((num_tokens, num_heads, num_splits), q)
    precision, upcast = dot_settings(q.dtype)
    k_cache, v_cache, k_scale, v_scale = kernel_kv_cache(k_cache, v_cache, kv_scales)
    if config.interleave_heads:
        grid = (num_q_tiles * num_kv_heads, num_splits)
    else:
        grid = (num_q_tiles, num_kv_heads, num_splits)
    _prefill_attention_kernel[grid](
        out, part_out, part_lse, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, k_scale,
        v_scale, scale * LOG2_E, sliding_window or NO_WINDOW, num_seqs, num_q_tiles, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=config.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=config.block_n,
        PARTITION_SIZE=0 if single else partition_size,  # 0 when unused: one variant for any partition
        NUM_STAGES=config.num_stages,
        PREFETCH_BLOCKS=config.prefetch_blocks,
        INTERLEAVE_HEADS=config.interleave_heads,
        SINGLE_SPLIT=single,
        DOT_PRECISION=precision,
        UPCAST_DOT=upcast,
        FP8_KV=k_scale is not None,
        E4M3_UPCAST=e4m3_upcast(q.device),
        FOLD_KV_SCALES=folds_kv_scales(k_scale is not None, fold_kv_scales),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch_options(q.device),
    )  # fmt: skip
    if not single:
        merge_attention_partials(part_out, part_lse, out)
    return out


def _split_partials(shape: tuple[int, int, int], q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized part_out [*shape, head_dim] and part_lse [*shape], fp32 on q's device (the kernel
    writes every entry the merge reads)."""
    part_out = torch.empty(*shape, q.shape[-1], dtype=torch.float32, device=q.device)
    return part_out, torch.empty(shape, dtype=torch.float32, device=q.device)


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """Plain PyTorch version of `prefill_attention`: gather each context (an FP8 one dequantized to q's
    dtype), mask, softmax in fp32."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    out = torch.empty_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[s], starts[s + 1])
        query_len = starts[s + 1] - starts[s]
        # Only positions some query's window reaches: entries before them may be freed blocks.
        first = 0 if sliding_window is None else max(seq_len - query_len - sliding_window + 1, 0)
        positions = torch.arange(first, seq_len, device=q.device)
        blocks = block_tables[s, positions // block_size].long()
        k, v = gather_kv_reference(k_cache, v_cache, blocks, positions % block_size, kv_scales, q.dtype)
        k = k.float().repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.float().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,thd->hqt", q[rows].float(), k) * scale
        query_positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
        hidden = positions[None, None, :] > query_positions[None, :, None]
        if sliding_window is not None:
            hidden |= positions[None, None, :] <= query_positions[None, :, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[rows] = torch.einsum("hqt,thd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
