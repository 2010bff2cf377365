"""Write one step's K/V into the paged cache at `slot_mapping`.

slot = block_id * block_size + offset          (slot < 0: padding row, skipped)
k_cache[slot // block_size, slot % block_size] = k[t]      for every token t
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.tensor_checks import check_store_kv_args


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    # One program per token; it moves all [num_kv_heads, head_dim] values of that token.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(k_dst + heads[:, None] * stride_kc_head + dims[None, :], k, mask=mask)
    tl.store(v_dst + heads[:, None] * stride_vc_head + dims[None, :], v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into k_cache, v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping [num_tokens] int64 (in place)."""
    check_store_kv_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain PyTorch version of `store_kv` (same arguments, same in-place effect)."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[valid]
    v_cache[blocks, offsets] = v[valid]
