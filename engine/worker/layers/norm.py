"""RMS norms: Llama's (`weight * normed`) and Gemma's (`(1 + weight) * normed`, all in fp32)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.worker.layers.custom_op import CustomOp
from sluice.engine.worker.layers.fp8_activations import Fp8Activations
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear_method import NormedRows
from sluice.kernels.cpu_rms_norm import EXTENSION as CPU_RMS_NORM
from sluice.kernels.cpu_rms_norm import cpu_rms_norm_prechecked

if TYPE_CHECKING:
    from sluice.engine.worker.layers.linear import LinearBase


class RMSNorm(CustomOp):
    """`norm(x [T, hidden], residual=None) -> (normed, residual_out)`, rounded like transformers'
    LlamaRMSNorm.

    With `residual`, x + residual (in x's dtype) is normalized and also returned as the next residual:
    the decoder's residual stream flows through the norms, so the add fuses into the norm kernel.
        triton  `sluice.kernels.rms_norm.rms_norm`, one pass over each row
        cpu     the C++ kernel `sluice.kernels.cpu_rms_norm` (one call instead of ~12 ATen ops)
        native  `F.rms_norm` in float32 (the same roundings, fewer passes), plain PyTorch in other dtypes

    `norm_for(linear, x, residual)` is the same for the norm's one consumer `linear`: on triton, where that
    linear takes its input quantized to FP8 this step, the kernel writes the codes instead of the normed x;
    where it normalizes its input itself (`normed_input`: `skinny_linears`, or an FP8 linear's one-row
    launch under `fuse_norm_fp8`), no kernel runs here.
    """

    implementations = ("triton", "cpu", "native")
    cpu_kernel = CPU_RMS_NORM

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.fuses_fp8_quant = False
        self.fuses_fp8_quant_groups = False
        self.fuses_into_linear = False

    def select(self, kernels: KernelConfig) -> None:
        super().select(kernels)
        # only an FP8 model asks its linears (`quantized_input`): others keep the plain call per step
        fp8 = kernels.quantization == "fp8"
        self.fuses_fp8_quant = self.implementation == "triton" and fp8 and kernels.fuse_fp8_quant_norm
        self.fuses_fp8_quant_groups = self.fuses_fp8_quant and kernels.fuse_fp8_quant_norm_groups
        self.fuses_into_linear = self.implementation == "triton" and (
            (kernels.skinny_linears and kernels.fuse_norm_skinny) or (fp8 and kernels.fuse_norm_fp8)
        )
        if self.implementation == "triton":  # imported only when chosen: triton is not installed everywhere
            module = import_module("sluice.kernels.rms_norm")
            self._triton_rms_norm, self._triton_rms_norm_fp8_quant = (
                module.rms_norm,
                module.rms_norm_fp8_quant,
            )

    def norm_for(
        self, linear: LinearBase, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | Fp8Activations | NormedRows, torch.Tensor]:
        """`self(x, residual)` as the input of `linear`, the normed x's only consumer: where `linear`
        normalizes these rows itself (`normed_input`, and this op fuses into it), x and the norm handed over
        as `NormedRows`, and the residual_out it will write (x itself without a residual); where this norm
        runs the Triton kernel and `linear` takes its input quantized for x's rows (`quantized_input`: an
        FP8 linear off its one-row gemv; per group of columns only with `fuses_fp8_quant_groups`), that
        kernel writes the codes and scales `linear` would compute (`rms_norm_fp8_quant`) and returns them
        in place of the normed x; the residual_out is the same."""
        if self.fuses_into_linear and linear.normed_input(x.shape[0]):
            residual_out = x if residual is None else torch.empty_like(x)
            normed = NormedRows(
                x, self.weight, self.eps, residual, None if residual is None else residual_out
            )
            return normed, residual_out
        scheme = linear.quantized_input(x.shape[0]) if self.fuses_fp8_quant else None
        if scheme is None or (scheme.group_size is not None and not self.fuses_fp8_quant_groups):
            return self(x, residual)
        x_q, x_scale, residual_out = self._triton_rms_norm_fp8_quant(
            x,
            self.weight,
            self.eps,
            residual,
            scheme.input_scale,
            group_size=scheme.group_size,
            scale_ub=scheme.scale_ub,
        )
        return Fp8Activations(x_q, x_scale, x.dtype), residual_out

    def forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._triton_rms_norm(x, self.weight, self.eps, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_rms_norm_prechecked(x, self.weight, self.eps, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The normed x alone (no residual), e.g. for per-head q/k norms over [..., head_dim]."""
        shape = x.shape
        return self(x.reshape(-1, shape[-1]))[0].view(shape)


class GemmaRMSNorm(CustomOp):
    """y = normed(x) * (1 + weight), computed in fp32 and cast back once, as transformers' Gemma3RMSNorm;
    plain PyTorch on every backend (the fused kernels round like Llama's norm).

    The checkpoint stores the offset `weight` (0 means identity). Applies over the last dimension.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
