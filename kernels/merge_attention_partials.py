"""Merge split-KV attention partials: each (token, head)'s slices of its context into one output.

A split-KV launch (`prefill_attention` with num_splits > 1) leaves, for every (token, head) and slice p of
the positions it attends to, the slice's normalized output and its log-sum-exp in base 2:

    part_out [num_tokens, num_heads, num_splits, head_dim] fp32     out_p = sum_t 2^(s_t - lse_p) v_t
    part_lse [num_tokens, num_heads, num_splits] fp32               lse_p = log2(sum_t 2^s_t)

    LSE = log2(sum_p 2^lse_p);    out = sum_p 2^(lse_p - LSE) * out_p

A slice in which a row sees no position (past its causal limit, before its window, or a slice its tile does
not have) has lse_p = -inf and weighs 0; its out_p is never read, so it may hold anything. Every row sees
at least its own position, so some slice has a finite lse_p.

One program per (token, head) walks the slices SPLIT_CHUNK at a time with an online maximum, so the split
count is a runtime value: one compiled variant serves every count (no JIT stall when a step picks a new
one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.tensor_checks import FLOAT_DTYPES, check_shape, check_tensor

SPLIT_CHUNK = 16  # slices loaded at once


@triton.jit(do_not_specialize=["num_splits"])
def _merge_attention_partials_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_splits,
    stride_o_token,
    stride_o_head,
    num_heads,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    wait_prior_kernel(PDL)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    row = (token * num_heads + head) * num_splits
    running_max = float("-inf")
    running_sum = 0.0
    acc = tl.zeros([DIM_PAD], tl.float32)
    for start in range(0, num_splits, SPLIT_CHUNK):
        splits = start + tl.arange(0, SPLIT_CHUNK)
        lse = tl.load(part_lse_ptr + row + splits, mask=splits < num_splits, other=float("-inf"))
        seen = lse > float("-inf")
        part = tl.load(
            part_out_ptr + (row + splits)[:, None] * HEAD_DIM + dims[None, :],
            mask=seen[:, None] & dim_mask[None, :],
            other=0.0,
        )
        new_max = tl.maximum(running_max, tl.max(lse, axis=0))
        # Until a slice with a finite lse comes, the maximum stays -inf: exponentials against 0 are 0.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.math.exp2(running_max - safe_max)
        weights = tl.math.exp2(lse - safe_max)
        running_sum = running_sum * alpha + tl.sum(weights, axis=0)
        acc = acc * alpha + tl.sum(part * weights[:, None], axis=0)
        running_max = new_max
    out = acc / running_sum
    out_ptrs = out_ptr + token * stride_o_token + head * stride_o_head + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def merge_attention_partials(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Writes into out [num_tokens, num_heads, head_dim] the merge of part_out [num_tokens, num_heads,
    num_splits, head_dim] fp32 (contiguous) by part_lse [num_tokens, num_heads, num_splits] fp32 (base 2,
    contiguous); returns out. Every (token, head) needs a slice with a finite lse."""
    check_tensor("part_out", part_out, ndim=4, dtypes=(torch.float32,), device=out.device)
    num_tokens, num_heads, num_splits, head_dim = part_out.shape
    check_tensor("part_lse", part_lse, ndim=3, dtypes=(torch.float32,), device=out.device)
    check_shape("part_lse", part_lse, (num_tokens, num_heads, num_splits))
    check_tensor("out", out, ndim=3, dtypes=FLOAT_DTYPES)
    check_shape("out", out, (num_tokens, num_heads, head_dim))
    if not (part_out.is_contiguous() and part_lse.is_contiguous()):
        raise ValueError("part_out, part_lse: must be contiguous")
    if num_tokens == 0 or num_heads == 0:
        return out
    _merge_attention_partials_kernel[(num_tokens, num_heads)](
        out, part_out, part_lse, num_splits, out.stride(0), out.stride(1), num_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        SPLIT_CHUNK=SPLIT_CHUNK,
        **pdl_launch_options(out.device),
    )  # fmt: skip
    return out


def merge_attention_partials_reference(part_out: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch version of `merge_attention_partials` (fp32 result): softmax weights over the slices'
    lse (base 2), slices with lse -inf excluded whatever their out holds."""
    weights = torch.softmax(part_lse * torch.log(torch.tensor(2.0)), dim=-1)  # 2^lse_p / sum_p 2^lse_p
    seen = torch.isfinite(part_lse)[..., None]
    return (torch.where(seen, part_out, 0.0) * weights[..., None]).sum(dim=2)
