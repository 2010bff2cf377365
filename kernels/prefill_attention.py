"""Variable-length causal attention over the paged KV cache (prefill chunks, prefix-cache hits, decodes).

Queries of many sequences are concatenated; sequence s owns rows query_start_loc[s] : query_start_loc[s+1].
Its K/V (cached prefix and this step's tokens, already written by `store_kv`) are read from the cache:

    context positions   0 ........ prefix_len-1 | prefix_len ........ seq_len-1
                        cached by earlier steps  | new tokens = this step's query rows
    query row j sits at position prefix_len + j and sees positions <= its own
    (and, with a sliding window W, > its own - W; a tile starts reading at its first row's window).

Grid (num_seqs, num_heads, cdiv(max_query_len, BLOCK_M)): one program per tile of BLOCK_M query rows
of one head; the online softmax runs over BLOCK_N context positions at a time, in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.paged_attention_tile import attend_paged_tile
from sluice.kernels.paged_decode_attention import NO_WINDOW
from sluice.kernels.tensor_checks import (
    check_block_tables,
    check_q_and_kv_cache,
    check_shape,
    check_tensor,
    output_like,
)

_BLOCK_M = 16
_BLOCK_N = 16


@triton.jit
def _prefill_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale,
    sliding_window,
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
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_tile = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if q_tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len
    kv_head = head // QUERIES_PER_KV

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_PAD)
    row_mask = rows < query_len
    dim_mask = dims < HEAD_DIM
    q_offsets = (query_start + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    query_positions = prefix_len + rows  # [BLOCK_M]
    # The last row of this tile sees up to its own position; nothing later is loaded.
    kv_end = tl.minimum(seq_len, prefix_len + (q_tile + 1) * BLOCK_M)
    # The first row of this tile sees nothing before its window; nothing earlier is loaded.
    kv_start = tl.maximum(prefix_len + q_tile * BLOCK_M - sliding_window + 1, 0)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    for tile_start in range(kv_start // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = (positions < kv_end) & (positions >= kv_start)
        visible = (positions[None, :] <= query_positions[:, None]) & pos_mask[None, :]
        visible &= positions[None, :] > query_positions[:, None] - sliding_window
        running_max, running_sum, acc = attend_paged_tile(
            q, running_max, running_sum, acc,
            k_cache_ptr + kv_head * stride_k_head, v_cache_ptr + kv_head * stride_v_head,
            block_tables_ptr + seq * stride_bt_seq, positions, pos_mask, visible, dims, dim_mask,
            stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, scale, BLOCK_SIZE, DOT_PRECISION,
        )  # fmt: skip

    out = acc / running_sum[:, None]
    o_offsets = (query_start + rows)[:, None] * stride_o_token + head * stride_o_head + dims[None, :]
    tl.store(
        out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :]
    )


def _check_prefill_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables) -> None:
    check_q_and_kv_cache(q, k_cache, v_cache)
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
) -> torch.Tensor:
    """Causal attention of q [num_tokens, num_heads, head_dim] over the paged cache.

    query_start_loc [num_seqs + 1] int32, seq_lens [num_seqs] int32, block_tables [num_seqs, max_blocks]
    int32; `max_query_len` >= every query length (sets the grid). Returns [num_tokens, num_heads, head_dim]
    (written into `out` when given). `sliding_window` W: each query sees the last W positions up to its own.
    """
    _check_prefill_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: must be > 0, got {sliding_window}")
    num_tokens, num_heads, head_dim = q.shape
    out = output_like("out", out, q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, _BLOCK_M))
    _prefill_attention_kernel[grid](
        out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window or NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=num_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain PyTorch version of `prefill_attention`: gather each context, mask, softmax in fp32."""
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
        k = (
            k_cache[blocks, positions % block_size]
            .float()
            .repeat_interleave(num_heads // num_kv_heads, dim=1)
        )
        v = (
            v_cache[blocks, positions % block_size]
            .float()
            .repeat_interleave(num_heads // num_kv_heads, dim=1)
        )
        scores = torch.einsum("qhd,thd->hqt", q[rows].float(), k) * scale
        query_positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
        hidden = positions[None, None, :] > query_positions[None, :, None]
        if sliding_window is not None:
            hidden |= positions[None, None, :] <= query_positions[None, :, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[rows] = torch.einsum("hqt,thd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
