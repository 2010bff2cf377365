"""RMSNorm with the residual add fused, float32 on CPU (the C++ kernel in `cpu_rms_norm.h`), and its
launcher. Its reference is `sluice.kernels.rms_norm.rms_norm_reference` (transformers' LlamaRMSNorm recipe):

    with residual:  residual_out = x + residual;  out = norm(residual_out)
    without:        residual_out = x;             out = norm(x)
    norm(h) = weight * (h * rsqrt(mean(h^2) + eps))

One call replaces the ~12 ATen ops of the composite, whose per-op cost is most of a norm's time at decode
batch sizes (the model runs 2 norms per layer per step).
"""

from __future__ import annotations

import torch

from sluice.kernels.cpu_extension import load_cpu_extension, require_cpu_extension
from sluice.kernels.tensor_checks import check_shape, check_tensor

EXTENSION = "cpu_rms_norm"
CPU = torch.device("cpu")


def cpu_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [num_tokens, hidden] float32 on CPU; weight [hidden]; residual like x or None. Returns (normed,
    residual_out), new tensors except residual_out = x without a residual. Raises ValueError naming a bad
    argument, RuntimeError if the kernel is not built."""
    check_tensor("x", x, ndim=2, dtypes=(torch.float32,), device=CPU)
    check_tensor("weight", weight, ndim=1, dtypes=(torch.float32,), device=CPU)
    check_shape("weight", weight, (x.shape[1],))
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(torch.float32,), device=CPU)
        check_shape("residual", residual, x.shape)
    require_cpu_extension(EXTENSION)
    return cpu_rms_norm_prechecked(x, weight, eps, residual)


def cpu_rms_norm_prechecked(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cpu_rms_norm` without its checks, for the model's norms (float32 CPU activations of the right
    width, the layer's own weight): one call per norm per step."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if residual is None:
        load_cpu_extension(EXTENSION).rms_norm(out, x, x, None, weight, eps)
        return out, x
    residual_out = torch.empty_like(x)
    load_cpu_extension(EXTENSION).rms_norm(out, residual_out, x, residual.contiguous(), weight, eps)
    return out, residual_out
