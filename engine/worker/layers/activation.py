"""Gated activations over a packed gate_up projection: [..., 2 * d] -> [..., d]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up (Llama, Mistral, Qwen)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
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
