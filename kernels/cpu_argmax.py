"""Row-wise argmax of float32 logits on CPU (the C++ kernel in `cpu_argmax.h`), and its launcher. It must
equal `x.argmax(dim=-1)`: the first maximum of each row, a NaN counting as the maximum.

Greedy sampling's pass over the logits: torch's CPU argmax does not vectorise (60 us a 49,152-token row;
docs/BENCHMARKS.md, "Figures behind the code").
"""

from __future__ import annotations

import torch

from sluice.kernels.cpu_extension import load_cpu_extension, require_cpu_extension
from sluice.kernels.tensor_checks import check_tensor

EXTENSION = "cpu_argmax"
CPU = torch.device("cpu")


def cpu_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [rows, vocab] float32 on CPU -> a new [rows] int64. Raises ValueError naming a bad argument,
    RuntimeError if the kernel is not built."""
    check_tensor("x", x, ndim=2, dtypes=(torch.float32,), device=CPU)
    require_cpu_extension(EXTENSION)
    return cpu_argmax_prechecked(x)


def cpu_argmax_prechecked(x: torch.Tensor) -> torch.Tensor:
    """`cpu_argmax` without its checks, for the sampler's own logits (float32 CPU rows)."""
    return load_cpu_extension(EXTENSION).argmax_rows(x)
