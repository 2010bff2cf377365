"""Gated activations over a packed gate_up projection: [T, 2 * d] -> [T, d]."""

from __future__ import annotations

from importlib import import_module

import torch
import torch.nn.functional as F

from sluice.engine.worker.layers.custom_op import CustomOp
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.kernels.cpu_silu_and_mul import EXTENSION as CPU_SILU_AND_MUL
from sluice.kernels.cpu_silu_and_mul import cpu_silu_and_mul_prechecked


class SiluAndMul(CustomOp):
    """silu(gate) * up (Llama, Mistral, Qwen), rounded as transformers' MLP rounds it; triton: one pass of
    `sluice.kernels.silu_and_mul` (the gate_up output read once); cpu: one pass of the C++ kernel
    `sluice.kernels.cpu_silu_and_mul`."""

    implementations = ("triton", "cpu", "native")
    cpu_kernel = CPU_SILU_AND_MUL

    def select(self, kernels: KernelConfig) -> None:
        super().select(kernels)
        if self.implementation == "triton":  # imported only when chosen: triton is not installed everywhere
            self._triton_silu_and_mul = import_module("sluice.kernels.silu_and_mul").silu_and_mul

    def forward_triton(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._triton_silu_and_mul(gate_up)

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_silu_and_mul_prechecked(gate_up)

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(CustomOp):
    """gelu_tanh(gate) * up (Gemma's `gelu_pytorch_tanh`)."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def get_act_and_mul(name: str) -> CustomOp:
    """The gated activation for config.json's `hidden_act` / `hidden_activation`."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act: {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()
