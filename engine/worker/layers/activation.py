"""Gated activations over a packed gate_up projection: [..., 2 * d] -> [..., d]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels.cpu_extension import cpu_extension_available
from sluice.kernels.cpu_silu_and_mul import EXTENSION as CPU_SILU_AND_MUL
from sluice.kernels.cpu_silu_and_mul import cpu_silu_and_mul_prechecked


class SiluAndMul(nn.Module):
    """silu(gate) * up (Llama, Mistral, Qwen); on CPU in float32 one pass of the C++ kernel
    `sluice.kernels.cpu_silu_and_mul`."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        cpu_float32 = gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" and gate_up.dim() == 2
        if cpu_float32 and cpu_extension_available(CPU_SILU_AND_MUL):
            return cpu_silu_and_mul_prechecked(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma's `gelu_pytorch_tanh`)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def get_act_and_mul(name: str) -> nn.Module:
    """The gated activation for config.json's `hidden_act` / `hidden_activation`."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act: {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()
