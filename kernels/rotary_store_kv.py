"""Rotary embedding and the KV-cache store fused: one kernel instead of `rotary_embedding` + `store_kv`.

For every token t (one program each):
    q[t], k[t] <- rotate(q[t]), rotate(k[t]) by positions[t]       (in place; "rotate half" layout)
    k_cache[slot // block_size, slot % block_size] = rotated k[t]  (slot = slot_mapping[t]; slot < 0:
    v_cache[slot // block_size, slot % block_size] = v[t]           a padding row, rotated but not stored)

The rotated k is written to the cache from registers, so k is read once instead of three times (rotate
read, rotate write back, store read). The rotation is `sluice.kernels.rotary`'s (fp32 math, one rounding);
the store is `sluice.kernels.store_kv`'s, an FP8 cache's e4m3 codes included (of k as rotated in its
dtype, as the two kernels would store it). Every layer on the Triton backend calls it
(`TritonAttentionBackend.rotate_and_store`, from `sluice.engine.worker.layers.attention.Attention`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.rotary import _rotate_heads, rotary_embedding_reference
from sluice.kernels.store_kv import (
    gpu_e4m3,
    kernel_kv_cache,
    load_store_scales,
    store_kv_reference,
    to_cache,
)
from sluice.kernels.tensor_checks import KVScales, check_rotary_args, check_store_kv_args


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr,  # FP8_KV only: [] fp32
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head, stride_cache,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_KV: tl.constexpr,
    HW_E4M3: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    token = tl.program_id(0)
    wait_prior_kernel(PDL)
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin_ptr + position * stride_cache + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cache + HALF + cols, mask=cols < HALF, other=0.0)
    _rotate_heads(q_ptr, q_ptr, token, stride_q_token, stride_q_head, stride_q_token, stride_q_head,
                  cos, sin, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)  # fmt: skip

    heads = tl.arange(0, KV_HEADS_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (cols[None, :] < HALF)
    k_src = k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + cols[None, :]
    k1 = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = k_ptr.dtype.element_ty
    rotated1 = (k1 * cos[None, :] - k2 * sin[None, :]).to(dtype)
    rotated2 = (k2 * cos[None, :] + k1 * sin[None, :]).to(dtype)
    tl.store(k_src, rotated1, mask=mask)
    tl.store(k_src + HALF, rotated2, mask=mask)

    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        k_scale, v_scale = load_store_scales(k_scale_ptr, v_scale_ptr, FP8_KV)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
        k_dst += heads[:, None] * stride_kc_head + cols[None, :]
        tl.store(k_dst, to_cache(rotated1, k_scale, FP8_KV, HW_E4M3), mask=mask)
        tl.store(k_dst + HALF, to_cache(rotated2, k_scale, FP8_KV, HW_E4M3), mask=mask)
        v_src = v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + cols[None, :]
        v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
        v_dst += heads[:, None] * stride_vc_head + cols[None, :]
        v1, v2 = tl.load(v_src, mask=mask), tl.load(v_src + HALF, mask=mask)
        tl.store(v_dst, to_cache(v1, v_scale, FP8_KV, HW_E4M3), mask=mask)
        tl.store(v_dst + HALF, to_cache(v2, v_scale, FP8_KV, HW_E4M3), mask=mask)


def rotary_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] in place by positions [T]
    (each < cos_sin_cache.shape[0]), then write the rotated k and v [T, num_kv_heads, head_dim] into
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping [T] int64 (slot < 0:
    not stored). An FP8 cache takes kv_scales (k_scale, v_scale) and gets e4m3 codes (`store_kv`). q, k,
    v may be strided views of a fused qkv projection. Returns (q, k).

    Raises ValueError naming the argument when shapes, dtypes, devices or strides do not fit.
    """
    check_rotary_args(positions, q, k, cos_sin_cache)
    check_store_kv_args(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    num_kv_heads = k.shape[1]
    k_cache, v_cache, k_scale, v_scale = kernel_kv_cache(k_cache, v_cache, kv_scales)
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        BLOCK_SIZE=k_cache.shape[1],
        FP8_KV=k_scale is not None,
        HW_E4M3=k_scale is not None and gpu_e4m3(q.device),
        **pdl_launch_options(q.device),
    )  # fmt: skip
    return q, k


def rotary_store_kv_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch version of `rotary_store_kv` (same arguments, same in-place effects)."""
    rotated_q, rotated_k = rotary_embedding_reference(positions, q, k, cos_sin_cache)
    q.copy_(rotated_q)
    k.copy_(rotated_k)
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    return q, k
