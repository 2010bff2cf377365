"""silu(gate) * up over a packed gate_up projection, float32 on CPU (the C++ kernel in
`cpu_silu_and_mul.h`), its launcher, and the plain PyTorch version it must equal:

    x [num_tokens, 2 * d] = [gate | up]  ->  [num_tokens, d] = silu(gate) * up

One pass instead of ATen's chunk, silu and mul: at decode batch sizes their per-op costs were ~12% of a
16-request step on SmolLM2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.kernels.cpu_extension import load_cpu_extension, require_cpu_extension
from sluice.kernels.tensor_checks import check_tensor

EXTENSION = "cpu_silu_and_mul"
CPU = torch.device("cpu")


def cpu_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, 2 * d] float32 on CPU -> a new [num_tokens, d]. Raises ValueError naming a bad
    argument, RuntimeError if the kernel is not built."""
    check_tensor("x", x, ndim=2, dtypes=(torch.float32,), device=CPU)
    if x.shape[1] % 2:
        raise ValueError(f"x: last dim must be even ([gate | up]), got {x.shape[1]}")
    require_cpu_extension(EXTENSION)
    return cpu_silu_and_mul_prechecked(x)


def cpu_silu_and_mul_prechecked(x: torch.Tensor) -> torch.Tensor:
    """`cpu_silu_and_mul` without its checks, for the MLP's own gate_up output (one call per layer)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], x.shape[1] // 2)
    load_cpu_extension(EXTENSION).silu_and_mul(out, x)
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch version of `cpu_silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
