"""Fused RMSNorm with an optional residual add, rounded like `transformers`' LlamaRMSNorm.

with residual:  residual_out = (x + residual) in x's dtype;  out = norm(residual_out)
without:        residual_out = x;                            out = norm(x)
norm(h) = weight * (h_fp32 * rsqrt(mean(h_fp32^2) + eps)).to(dtype)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.tensor_checks import (
    FLOAT_DTYPES,
    check_same_dtype,
    check_shape,
    check_tensor,
    output_like,
)


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    HIDDEN: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, HIDDEN_PAD)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first, as the unfused model does.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    normed = (h * inv_rms).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rms_norm_args(x, weight, residual) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, device=x.device)
    check_shape("weight", weight, (x.shape[1],))
    check_same_dtype("weight", weight, x.dtype)
    if residual is not None:
        check_tensor("residual", residual, ndim=2, device=x.device)
        check_shape("residual", residual, x.shape)
        check_same_dtype("residual", residual, x.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [num_tokens, hidden] (after adding `residual` when given).

    Returns (normed, residual_out), both new [num_tokens, hidden] tensors in x's dtype; residual_out
    is the un-normalized input of the norm, i.e. the next layer's residual. Without `residual` it is x.
    `out` / `residual_out` may be given to write into (residual_out may alias residual: in-place add).
    """
    _check_rms_norm_args(x, weight, residual)
    num_tokens, hidden = x.shape
    out = output_like("out", out, x)
    residual_out = output_like("residual_out", residual_out, x) if residual is not None else x
    if num_tokens == 0:
        return out, residual_out
    _rms_norm_kernel[(num_tokens,)](
        out,
        residual_out,
        x,
        residual if residual is not None else x,
        weight,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        residual_out.stride(0),
        HIDDEN=hidden,
        HIDDEN_PAD=triton.next_power_of_2(hidden),
        HAS_RESIDUAL=residual is not None,
    )
    return out, residual_out


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch version of `rms_norm` (the LlamaRMSNorm recipe)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x
