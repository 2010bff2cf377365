"""Block-wise FP8 (DeepSeek-V3, Qwen3-*-FP8, llm-compressor's FP8_BLOCK) for `Fp8LinearMethod`: the plain
PyTorch pieces of its CPU path, and which block scales a tensor-parallel rank holds.

    weight   codes [N, K] e4m3, scale [cdiv(N, bn), cdiv(K, bk)] float32:
             w[n, k] = codes[n, k] * scale[n // bn, k // bk]
    input    x_q [M, K] e4m3, x_scale [M, cdiv(K, bk)] float32, per row and group of bk columns:
             x[m, k] ~ x_q[m, k] * x_scale[m, k // bk]

`quantize_activation_groups` is what `sluice.kernels.fp8_block_mm.quantize_fp8_groups` equals bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from sluice.engine.worker.layers.linear import LinearBase

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = torch.finfo(torch.float32).tiny  # an all-zero group quantizes to zeros, not NaN


def per_element_scales(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """scale [cdiv(rows, block[0]), cdiv(columns, block[1])] -> [rows, columns] = shape: each element's
    scale, scale[r // block[0], c // block[1]] (edge blocks cut to the shape). Activation groups are
    blocks of (1, group_size)."""
    expanded = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return expanded[: shape[0], : shape[1]]


def quantize_activation_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] e4m3, x_scale [M, cdiv(K, group_size)] float32): a scale per row and group of
    `group_size` consecutive columns (the last group may be narrower), max |x| -> 448, as
    `quantize_activations`'s token scale per group; x ~ x_q * x_scale[:, k // group_size]."""
    x = x.float()
    num_groups = -(-x.shape[1] // group_size)
    padded = F.pad(x, (0, num_groups * group_size - x.shape[1]))  # zero columns: the amax stays
    amax = padded.view(x.shape[0], num_groups, group_size).abs().amax(dim=2)
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x / per_element_scales(scale, (1, group_size), x.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes [N, K] e4m3, scale [cdiv(N, bn), cdiv(K, bk)] float32): max |w| -> 448 per
    block (edge blocks partial), as llm-compressor's FP8_BLOCK and DeepSeek's blocks are made."""
    w = weight.float()
    (rows, columns), (block_n, block_k) = w.shape, block
    num_n, num_k = -(-rows // block_n), -(-columns // block_k)
    padded = F.pad(w, (0, num_k * block_k - columns, 0, num_n * block_n - rows))
    amax = padded.view(num_n, block_n, num_k, block_k).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / per_element_scales(scale, block, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """codes [N, K] e4m3 with scale [cdiv(N, block[0]), cdiv(K, block[1])] -> w [N, K] float32,
    w[n, k] = codes[n, k] * scale[n // block[0], k // block[1]]."""
    return codes.float() * per_element_scales(scale, block, codes.shape)


def rank_block_scales(
    layer: LinearBase, loaded: torch.Tensor, shard: int | None, block: tuple[int, int]
) -> torch.Tensor:
    """A checkpoint's block scales -> this tensor-parallel rank's: the block rows of its rows (column
    parallel) or the block columns of its columns (row parallel). Every rank's part must fill whole blocks
    (checked alike on every rank, so that all refuse a layout together)."""
    group = getattr(layer, "group", None)
    if group is None or group.size == 1:
        return loaded
    block_n, block_k = block
    if layer.input_size != layer.checkpoint_input_size:  # row parallel
        if layer.input_size % block_k:
            raise ValueError(
                f"tensor_parallel_size {group.size}: a rank's {layer.input_size} input columns of a "
                f"row-parallel projection do not fill whole weight blocks of {block_k} columns"
            )
        first = group.rank * layer.input_size // block_k
        return loaded[:, first : first + layer.input_size // block_k]
    rank_rows = getattr(layer, "rank_rows", None)
    if rank_rows is None:
        return loaded
    rows = rank_rows(shard or 0)
    if (rows.stop - rows.start) % block_n:
        raise ValueError(
            f"tensor_parallel_size {group.size}: a rank's {rows.stop - rows.start} rows of a column-parallel "
            f"projection do not fill whole weight blocks of {block_n} rows"
        )
    return loaded[rows.start // block_n : rows.stop // block_n]
