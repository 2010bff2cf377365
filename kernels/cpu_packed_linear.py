"""y = x W^T (+ b) on CPU in float32 with W packed in column panels (the C++ kernel in
`cpu_packed_linear.h`), its launcher, and the plain PyTorch version it must equal.

    W [N, K]  ->  packed [num_panels, K, P]     packed[p, k, j] = W[p * P + j, k], 0 past row N-1

         k ->                       panel 0 = W[0:P].T     (one contiguous K x P block)
    W  [ row 0   ... ]              panel 1 = W[P:2P].T
       [ row 1   ... ]      ->      ...
       [ ...         ]              last panel zero-padded to P columns

P, the panel width (`panel_width()`), is the build's micro-kernel width: 16 columns with AVX2, 64 with
AVX-512, 8 with SSE or NEON.

The layer packs its weight once at load (`pack_weight`); each matmul then streams the panels front to
back. It beats MKL's sgemm on decode-sized steps, where sgemm on a few rows is far from the bandwidth and
FMA limits, and matches or beats it on prefill-sized ones (docs/BENCHMARKS.md, "Figures behind the code").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.kernels.cpu_extension import (
    cpu_extension_unavailable_reason,
    load_cpu_extension,
    require_cpu_extension,
)
from sluice.kernels.tensor_checks import check_shape, check_tensor

EXTENSION = "cpu_packed_linear"
CPU = torch.device("cpu")


def packed_linear_unavailable_reason(weight: torch.Tensor) -> str | None:
    """None when `weight` can be packed for the kernel (float32, on CPU, kernel built), else why not."""
    if weight.device != CPU or weight.dtype != torch.float32:
        return f"runs float32 weights on cpu, got {weight.dtype} on {weight.device}"
    return cpu_extension_unavailable_reason(EXTENSION)


def panel_width() -> int:
    """Columns per panel: the built kernel's kPanel. Raises RuntimeError if the kernel is not built."""
    return require_cpu_extension(EXTENSION).PANEL


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> packed [ceil(N / P), K, P] (P = `panel_width()`), contiguous, zero-padded columns."""
    check_tensor("weight", weight, ndim=2, dtypes=(torch.float32,), last_dim_contiguous=False)
    panel = panel_width()
    output_size, input_size = weight.shape
    num_panels = -(-output_size // panel)
    padded = F.pad(weight, (0, 0, 0, num_panels * panel - output_size))
    return padded.reshape(num_panels, panel, input_size).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor, output_size: int) -> torch.Tensor:
    """The inverse of `pack_weight`: packed [num_panels, K, P] -> W [output_size, K]."""
    num_panels, input_size, panel = packed.shape
    return packed.transpose(1, 2).reshape(num_panels * panel, input_size)[:output_size]


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, output_size: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] float32 on CPU; packed [num_panels, K, P] from `pack_weight`; bias [output_size] or
    None. Returns [..., output_size]. Raises ValueError naming a bad argument, RuntimeError if the kernel
    is not built."""
    check_tensor("x", x, ndim=x.dim(), dtypes=(torch.float32,), device=CPU, last_dim_contiguous=False)
    check_tensor("packed", packed, ndim=3, dtypes=(torch.float32,), device=CPU)
    if not packed.is_contiguous():
        raise ValueError(f"packed: must be contiguous, strides are {packed.stride()}")
    panel = panel_width()
    check_shape("packed", packed, (-(-output_size // panel), x.shape[-1], panel))
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(torch.float32,), device=CPU)
        check_shape("bias", bias, (output_size,))
    return packed_linear_prechecked(x, packed, output_size, bias)


def packed_linear_prechecked(
    x: torch.Tensor, packed: torch.Tensor, output_size: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`packed_linear` without its checks, for a layer whose packed weight and bias were checked when they
    were made: the hot path (one call per linear layer per step)."""
    if x.dim() != 2:  # the model's activations are [num_tokens, hidden]: no reshapes on the hot path
        return packed_linear_prechecked(x.reshape(-1, x.shape[-1]), packed, output_size, bias).view(
            *x.shape[:-1], output_size
        )
    rows = x.contiguous()
    y = torch.empty(rows.shape[0], output_size)
    load_cpu_extension(EXTENSION).packed_linear(y, rows, packed, bias)
    return y


def packed_linear_reference(
    x: torch.Tensor, packed: torch.Tensor, output_size: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The plain PyTorch version of `packed_linear`."""
    return F.linear(x, unpack_weight(packed, output_size), bias)
