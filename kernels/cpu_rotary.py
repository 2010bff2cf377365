"""Rotary position embedding in place, float32 on CPU (the C++ kernel in `cpu_rotary.h`), and its
launcher. Same layout and table as the Triton kernel in `kernels/rotary.py`, whose
`rotary_embedding_reference` is its reference:

    cos_sin_cache[p] = [cos(p * inv_freq) | sin(p * inv_freq)]       [max_position, head_dim] fp32
    x = [x1 | x2]  (halves of head_dim)  ->  [x1 * cos - x2 * sin | x2 * cos + x1 * sin]

One call per layer rotates q and k in place, where the PyTorch path runs ~14 ATen ops and allocates new
q and k.
"""

from __future__ import annotations

import torch

from sluice.kernels.cpu_extension import load_cpu_extension, require_cpu_extension
from sluice.kernels.tensor_checks import check_rotary_args

EXTENSION = "cpu_rotary"
CPU = torch.device("cpu")


def cpu_rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] (float32 on
    CPU, possibly strided views of a fused qkv projection) in place by `positions` [num_tokens] (every
    entry < cos_sin_cache.shape[0]). Returns (q, k). Raises ValueError naming a bad argument,
    RuntimeError if the kernel is not built."""
    check_rotary_args(positions, q, k, cos_sin_cache)
    if q.device != CPU or q.dtype != torch.float32:
        raise ValueError(f"q: the C++ kernel runs float32 on cpu, got {q.dtype} on {q.device}")
    rows = cos_sin_cache.shape[0]
    if positions.numel() and not (int(positions.min()) >= 0 and int(positions.max()) < rows):
        # The kernel reads the table at each position unchecked: out of range, another row or SIGSEGV.
        raise ValueError(f"positions: must be in [0, {rows}) (the cos/sin table's rows)")
    require_cpu_extension(EXTENSION)
    return cpu_rotary_embedding_prechecked(positions, q, k, cos_sin_cache)


def cpu_rotary_embedding_prechecked(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cpu_rotary_embedding` without its checks, for the model's own q, k, positions and table: one call
    per layer."""
    load_cpu_extension(EXTENSION).rotary_embedding(q, k, positions.long(), cos_sin_cache)
    return q, k
