"""The gated feed-forward block every supported decoder uses: down(act(gate) * up)."""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine.worker.layers.activation import get_act_and_mul
from sluice.engine.worker.layers.fp8_activations import Fp8Activations
from sluice.engine.worker.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """x [T, hidden] -> [T, hidden]; gate and up run as one packed matmul (gate_up_proj = [gate; up]).
    Under tensor parallelism each rank holds 1/N of the intermediate columns: gate_up column-parallel,
    down row-parallel (one all-reduce)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        bias: bool = False,
        activation_field: str = "hidden_act",
    ) -> None:
        super().__init__()
        sizes = (intermediate_size, intermediate_size)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, sizes, bias)
        self.act = get_act_and_mul(activation, activation_field)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        """x: the hidden states, or their FP8 codes where gate_up_proj asked for them (`RMSNorm.norm_for`)."""
        return self.down_proj(self.act.activate_for(self.down_proj, self.gate_up_proj(x)))
