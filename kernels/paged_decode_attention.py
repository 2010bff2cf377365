"""Decode attention over the paged KV cache: one query token per sequence, split along the context.

Flash-decoding in two kernels:

    partition kernel   grid (num_seqs, num_kv_heads, num_partitions)
        each program takes the query heads sharing one KV head (GQA) and one slice of
        `partition_size` context positions, and writes its unnormalized output, running max
        and exp-sum (all fp32) for that slice.
    reduce kernel      grid (num_seqs, num_heads)
        combines the slices with the log-sum-exp:  out = sum_p acc_p * e^(m_p - M) / sum_p l_p * e^(m_p - M)

Context position p of sequence s lives at k_cache[block_tables[s, p // block_size], p % block_size].
With a sliding window W only positions seq_len - W .. seq_len - 1 are read; partitions wholly before
them store an empty softmax (max -inf, sum 0) that the reduction weighs 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.paged_attention_tile import attend_paged_tile
from sluice.kernels.tensor_checks import (
    check_block_tables,
    check_q_and_kv_cache,
    check_shape,
    check_tensor,
    output_like,
)

DEFAULT_PARTITION_SIZE = 512
_TILE_N = 16  # context positions per inner step; tl.dot needs every dim >= 16 on GPUs
_MIN_DOT_ROWS = 16
NO_WINDOW = 2**31 - 1  # sliding_window passed to the kernels for full attention


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_acc_ptr,  # [num_seqs, num_heads, max_partitions, head_dim] fp32
    part_max_ptr,  # [num_seqs, num_heads, max_partitions] fp32
    part_sum_ptr,  # [num_seqs, num_heads, max_partitions] fp32
    scale,
    sliding_window,
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    num_heads,
    max_partitions,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    if start >= seq_len:
        return
    end = tl.minimum(start + PARTITION_SIZE, seq_len)
    window_start = tl.maximum(seq_len - sliding_window, 0)
    first_tile = tl.maximum(start, window_start // TILE_N * TILE_N)

    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * QUERIES_PER_KV + groups
    group_mask = groups < QUERIES_PER_KV
    dim_mask = dims < HEAD_DIM
    q_mask = group_mask[:, None] & dim_mask[None, :]
    # q: [GROUP_PAD, DIM_PAD]; padded rows are 0 and never stored.
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :], mask=q_mask, other=0.0
    )

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for tile_start in range(first_tile, end, TILE_N):
        positions = tile_start + tl.arange(0, TILE_N)
        pos_mask = (positions < end) & (positions >= window_start)
        running_max, running_sum, acc = attend_paged_tile(
            q, running_max, running_sum, acc,
            k_cache_ptr + kv_head * stride_k_head, v_cache_ptr + kv_head * stride_v_head,
            block_tables_ptr + seq * stride_bt_seq, positions, pos_mask, pos_mask[None, :], dims, dim_mask,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, scale, BLOCK_SIZE, DOT_PRECISION,
        )  # fmt: skip

    stat_offsets = (seq * num_heads + heads) * max_partitions + part
    tl.store(part_max_ptr + stat_offsets, running_max, mask=group_mask)
    tl.store(part_sum_ptr + stat_offsets, running_sum, mask=group_mask)
    tl.store(part_acc_ptr + stat_offsets[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    seq_lens_ptr,
    stride_o_seq,
    stride_o_head,
    num_heads,
    max_partitions,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    PARTS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION_SIZE)
    parts = tl.arange(0, PARTS_PAD)
    dims = tl.arange(0, DIM_PAD)
    part_mask = parts < num_parts
    stat_offsets = (seq * num_heads + head) * max_partitions + parts

    part_max = tl.load(part_max_ptr + stat_offsets, mask=part_mask, other=float("-inf"))
    global_max = tl.max(part_max, axis=0)
    global_max = tl.where(num_parts > 0, global_max, 0.0)
    # A sequence with no context (seq_len 0, e.g. a padding row) has no partitions: output 0.
    weights = tl.where(part_mask, tl.exp(part_max - global_max), 0.0)
    part_sum = tl.load(part_sum_ptr + stat_offsets, mask=part_mask, other=0.0)
    total = tl.sum(part_sum * weights, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    acc_mask = part_mask[:, None] & (dims[None, :] < HEAD_DIM)
    part_acc = tl.load(
        part_acc_ptr + stat_offsets[:, None] * HEAD_DIM + dims[None, :], mask=acc_mask, other=0.0
    )
    out = tl.sum(part_acc * weights[:, None], axis=0) / total
    out_ptrs = out_ptr + seq * stride_o_seq + head * stride_o_head + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, partition_size, sliding_window) -> None:
    check_q_and_kv_cache(q, k_cache, v_cache)
    num_seqs = q.shape[0]
    check_block_tables(block_tables, num_seqs, q.device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=q.device)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    if partition_size <= 0 or partition_size % _TILE_N:
        raise ValueError(f"partition_size: {partition_size} must be a positive multiple of {_TILE_N}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: must be > 0, got {sliding_window}")


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
) -> torch.Tensor:
    """Attention of q [num_seqs, num_heads, head_dim] (one new token per sequence) over each
    sequence's first seq_lens[s] cached positions. Returns [num_seqs, num_heads, head_dim] in q's dtype.

    `max_seq_len` bounds every seq_lens entry and sets the partition grid; under CUDA graphs pass the
    largest context the graph may see (the grid is frozen at capture). `out`, when given, receives
    the result (same shape and dtype as q). `sliding_window` W: attend to the last W positions only
    (block-table entries before them are never read).
    """
    _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, partition_size, sliding_window)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = output_like("out", out, q)
    if num_seqs == 0:
        return out
    max_partitions = max(1, triton.cdiv(max_seq_len, partition_size))
    part_acc = torch.empty(
        num_seqs, num_heads, max_partitions, head_dim, dtype=torch.float32, device=q.device
    )
    part_max = torch.empty(num_seqs, num_heads, max_partitions, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    queries_per_kv = num_heads // num_kv_heads
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    _decode_partition_kernel[(num_seqs, num_kv_heads, max_partitions)](
        q, k_cache, v_cache, block_tables, seq_lens, part_acc, part_max, part_sum, scale,
        sliding_window or NO_WINDOW, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), num_heads, max_partitions,
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PAD=max(_MIN_DOT_ROWS, triton.next_power_of_2(queries_per_kv)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=k_cache.shape[1],
        TILE_N=_TILE_N,
        PARTITION_SIZE=partition_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    _decode_reduce_kernel[(num_seqs, num_heads)](
        out, part_acc, part_max, part_sum, seq_lens,
        out.stride(0), out.stride(1), num_heads, max_partitions,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        PARTITION_SIZE=partition_size,
        PARTS_PAD=triton.next_power_of_2(max_partitions),
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
) -> torch.Tensor:
    """Plain PyTorch version of `paged_decode_attention`: gather each context, softmax in fp32."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(max(seq_len - (sliding_window or seq_len), 0), seq_len, device=q.device)
        blocks = block_tables[s, positions // block_size].long()
        k = k_cache[blocks, positions % block_size].float()  # [num_positions, num_kv_heads, head_dim]
        v = v_cache[blocks, positions % block_size].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[s].float(), k) * scale
        out[s] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
