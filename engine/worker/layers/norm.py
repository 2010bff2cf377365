"""RMS norms: Llama's (`weight * normed`) and Gemma's (`(1 + weight) * normed`, all in fp32)."""

from __future__ import annotations

from importlib import import_module

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels.cpu_extension import cpu_extension_available
from sluice.kernels.cpu_rms_norm import EXTENSION as CPU_RMS_NORM
from sluice.kernels.cpu_rms_norm import cpu_rms_norm_prechecked


class RMSNorm(nn.Module):
    """`norm(x, residual=None) -> (normed, residual_out)`, rounded like transformers' LlamaRMSNorm.

    With `residual`, x + residual (in x's dtype) is normalized and also returned as the next residual:
    the decoder's residual stream flows through the norms, so the add fuses into the norm kernel.
    use_triton: `sluice.kernels.rms_norm.rms_norm`, one pass over each row. On CPU in float32, the C++ kernel
    `sluice.kernels.cpu_rms_norm` (one call instead of ~12 ATen ops); without it `F.rms_norm`; other dtypes
    plain PyTorch.
    """

    def __init__(self, hidden_size: int, eps: float, use_triton: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.use_triton = use_triton
        # Imported only when used: triton is not installed everywhere the torch path runs.
        self._fused = import_module("sluice.kernels.rms_norm").rms_norm if use_triton else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fused is not None:
            return self._fused(x, self.weight, self.eps, residual)
        cpu_float32 = x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
        if cpu_float32 and cpu_extension_available(CPU_RMS_NORM):
            return cpu_rms_norm_prechecked(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        if x.dtype == torch.float32:  # torch's fused op: the same roundings in float32, fewer passes
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The normed x alone (no residual), e.g. for per-head q/k norms over [..., head_dim]."""
        shape = x.shape
        return self(x.reshape(-1, shape[-1]))[0].view(shape)


class GemmaRMSNorm(nn.Module):
    """y = normed(x) * (1 + weight), computed in fp32 and cast back once, as transformers' Gemma3RMSNorm.

    The checkpoint stores the offset `weight` (0 means identity). Applies over the last dimension.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
