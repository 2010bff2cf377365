"""One step of attention over a paged KV cache, shared by the decode and prefill kernels.

A tile is N context positions of one sequence and one KV head. Position p lives at
    cache[block_table[p // BLOCK_SIZE], p % BLOCK_SIZE, kv_head, :]
The step gathers the tile's K and V through the block table, scores the query rows against K, masks
what a row may not see, and folds the tile into the running online softmax (all fp32):
    m' = max(m, rowmax(s));  l' = l * e^(m - m') + rowsum(e^(s - m'));  acc' = acc * e^(m - m') + e^(s - m') V
A row that sees nothing in this tile (or before it: a sliding window starts later for later rows) keeps
m' = -inf; its exponentials are taken against 0 instead, so they are 0, never NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_paged_tile(
    q,  # [M, DIM_PAD] query rows (padded rows are 0)
    running_max,  # [M] fp32
    running_sum,  # [M] fp32
    acc,  # [M, DIM_PAD] fp32
    k_head_ptr,  # k_cache + kv_head * stride_k_head
    v_head_ptr,  # v_cache + kv_head * stride_v_head
    block_table_ptr,  # this sequence's row of the block table
    positions,  # [N] context positions of the tile
    pos_mask,  # [N] positions to load (inside what this program reads; never a freed block)
    visible,  # [M, N] or [1, N]: which positions each row may attend to
    dims,  # [DIM_PAD]
    dim_mask,  # [DIM_PAD]
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    scale,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Returns the updated (running_max, running_sum, acc)."""
    blocks = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=pos_mask, other=0).to(
        tl.int64
    )  # block * stride_k_block can pass 2**31 in a large cache
    offsets = positions % BLOCK_SIZE
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k_rows = k_head_ptr + blocks * stride_k_block + offsets * stride_k_slot
    k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, DIM_PAD]
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [M, N]
    scores = tl.where(visible, scores, float("-inf"))

    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    probs = tl.exp(scores - safe_max[:, None])
    alpha = tl.exp(running_max - safe_max)
    running_sum = running_sum * alpha + tl.sum(probs, axis=1)
    v_rows = v_head_ptr + blocks * stride_v_block + offsets * stride_v_slot
    v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, DIM_PAD]
    acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc
