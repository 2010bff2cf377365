"""Rotary position embedding (the "rotate half" / NeoX layout used by Llama, Mistral and Qwen2).

    cos_sin_cache[p] = [cos(p * inv_freq) | sin(p * inv_freq)]        [max_position, head_dim] fp32
    x = [x1 | x2]  (halves of head_dim)  ->  [x1 * cos - x2 * sin | x2 * cos + x1 * sin]

The table comes from `sluice.engine.worker.layers.rotary.build_cos_sin_cache` (plain or scaled frequencies;
with "yarn", cos and sin already carry its attention factor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.tensor_checks import check_rotary_args, output_like


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, token, stride_src_token, stride_src_head, stride_dst_token, stride_dst_head,
    cos, sin, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < NUM_HEADS) & (cols[None, :] < HALF)
    src = src_ptr + token * stride_src_token + heads[:, None] * stride_src_head + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_dst_token + heads[:, None] * stride_dst_head + cols[None, :]
    out_dtype = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    stride_qo_token, stride_qo_head, stride_ko_token, stride_ko_head, stride_cache,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    # One program per token: all its q heads and k heads share one cos/sin row.
    token = tl.program_id(0)
    wait_prior_kernel(PDL)
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin_ptr + position * stride_cache + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cache + HALF + cols, mask=cols < HALF, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_q_token, stride_q_head, stride_qo_token, stride_qo_head,
                  cos, sin, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)  # fmt: skip
    _rotate_heads(k_ptr, k_out_ptr, token, stride_k_token, stride_k_head, stride_ko_token, stride_ko_head,
                  cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    inplace: bool = True,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] by
    `positions` [num_tokens] (every entry < cos_sin_cache.shape[0]). q and k may be strided views
    (e.g. of a fused qkv projection). Returns (q, k) when `inplace`; otherwise writes `out`
    (q_out, k_out) when given, else new tensors."""
    check_rotary_args(positions, q, k, cos_sin_cache)
    if inplace:
        if out is not None:
            raise ValueError("out: must be None when inplace=True")
        q_out, k_out = q, k
    else:
        q_out = output_like("out[0]", out[0] if out is not None else None, q)
        k_out = output_like("out[1]", out[1] if out is not None else None, k)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return q_out, k_out
    num_kv_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        **pdl_launch_options(q.device),
    )  # fmt: skip
    return q_out, k_out


def rotary_embedding_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch version of `rotary_embedding` (out of place, fp32 math, one rounding)."""
    half = q.shape[-1] // 2
    cos = cos_sin_cache[positions.long(), :half][:, None, :]
    sin = cos_sin_cache[positions.long(), half:][:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
