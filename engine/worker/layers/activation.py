"""Gated activations over a packed gate_up projection: [T, 2 * d] -> [T, d]."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sluice.engine.worker.layers.custom_op import CustomOp
from sluice.engine.worker.layers.fp8_activations import Fp8Activations
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear_method import GatedRows
from sluice.kernels.cpu_silu_and_mul import EXTENSION as CPU_SILU_AND_MUL
from sluice.kernels.cpu_silu_and_mul import cpu_silu_and_mul_prechecked

if TYPE_CHECKING:
    from sluice.engine.worker.layers.linear import LinearBase


class GatedActivation(CustomOp):
    """act(gate) * up over gate_up [T, 2 * d]; `activate_for(linear, gate_up)` is the same as the input of
    `linear`, its one consumer (an activation that fuses FP8 quantization overrides it)."""

    def activate_for(self, linear: LinearBase, gate_up: torch.Tensor) -> torch.Tensor | Fp8Activations:
        return self(gate_up)


class SiluAndMul(GatedActivation):
    """silu(gate) * up (Llama, Mistral, Qwen), rounded as transformers' MLP rounds it; triton: one pass of
    `sluice.kernels.silu_and_mul` (the gate_up output read once); cpu: one pass of the C++ kernel
    `sluice.kernels.cpu_silu_and_mul`. On triton, where the consumer linear takes its input quantized to FP8
    this step, `activate_for` writes the codes and scales instead (`silu_and_mul_fp8_quant`); where it
    activates [gate | up] itself (`gated_input`: `skinny_linears`, or an FP8 linear's one-row launch under
    `fuse_silu_fp8`), it hands over gate_up untouched."""

    implementations = ("triton", "cpu", "native")
    cpu_kernel = CPU_SILU_AND_MUL

    def __init__(self) -> None:
        super().__init__()
        self.fuses_fp8_quant = False
        self.fuses_into_linear = False

    def select(self, kernels: KernelConfig) -> None:
        super().select(kernels)
        # only an FP8 model asks its linears (`quantized_input`): others keep the plain call per step
        fp8 = kernels.quantization == "fp8"
        self.fuses_fp8_quant = self.implementation == "triton" and fp8 and kernels.fuse_fp8_quant_silu
        self.fuses_into_linear = self.implementation == "triton" and (
            (kernels.skinny_linears and kernels.fuse_silu_skinny) or (fp8 and kernels.fuse_silu_fp8)
        )
        if self.implementation == "triton":  # imported only when chosen: triton is not installed everywhere
            module = import_module("sluice.kernels.silu_and_mul")
            self._triton_silu_and_mul = module.silu_and_mul
            self._triton_silu_and_mul_fp8_quant = module.silu_and_mul_fp8_quant

    def activate_for(
        self, linear: LinearBase, gate_up: torch.Tensor
    ) -> torch.Tensor | Fp8Activations | GatedRows:
        """silu(gate) * up as `linear`'s input: gate_up itself where `linear.gated_input` takes these rows
        (and this op fuses into it), its FP8 codes and scales where `linear.quantized_input` asks for them
        for these rows (and this op runs the Triton kernel), else the activated tensor. Under tensor
        parallelism gate_up is this rank's columns and `linear` the row-parallel down_proj holding the
        matching input columns: each row's amax is over this rank's part, as the linear's own launch takes."""
        if self.fuses_into_linear and linear.gated_input(gate_up.shape[0]):
            return GatedRows(gate_up)
        scheme = linear.quantized_input(gate_up.shape[0]) if self.fuses_fp8_quant else None
        if scheme is None:
            return self(gate_up)
        x_q, x_scale = self._triton_silu_and_mul_fp8_quant(
            gate_up, scheme.input_scale, group_size=scheme.group_size, scale_ub=scheme.scale_ub
        )
        return Fp8Activations(x_q, x_scale, gate_up.dtype)

    def forward_triton(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._triton_silu_and_mul(gate_up)

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_silu_and_mul_prechecked(gate_up)

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(GatedActivation):
    """gelu_tanh(gate) * up (Gemma's `gelu_pytorch_tanh`; transformers' `gelu_new` is the same function)."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GeluAndMul(GatedActivation):
    """gelu(gate) * up, the exact (erf) GELU: transformers' `gelu`."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate) * up


# transformers' ACT2FN names: `swish` is its SiLU, `gelu_new` its own tanh approximation of GELU.
_ACTIVATIONS: dict[str, type[GatedActivation]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_new": GeluTanhAndMul,
    "gelu": GeluAndMul,
}


def get_act_and_mul(name: str, field: str = "hidden_act") -> GatedActivation:
    """The gated activation for config.json's `hidden_act` (or Gemma's `hidden_activation`: `field`)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"{field}: {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()
