"""Argument checks shared by the kernel launchers: each failure is a ValueError naming the bad argument."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
) -> None:
    """Raise ValueError unless `tensor` has `ndim` dims, one of `dtypes`, lives on `device`, and
    (by default) a unit stride on its last dim, which every kernel here assumes."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {tensor.dtype} is not one of {tuple(dtypes)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: on {tensor.device}, expected {device}")
    if last_dim_contiguous and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous (stride 1), strides are {tensor.stride()}")


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    """Raise ValueError unless `tensor.shape == expected`."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_power_of_two(name: str, value: int, least: int) -> None:
    """Raise ValueError unless `value` is a power of two >= `least` (a kernel tile's size)."""
    if value < least or value & (value - 1):
        raise ValueError(f"{name}: must be a power of two >= {least}, got {value}")


def check_scale_and_window(scale: float, sliding_window: int | None) -> None:
    """Raise ValueError unless the softmax `scale` is a finite number > 0 (the attention kernels scale each
    row's maximum score rather than every score: the maximum of the scaled scores only for a positive
    scale) and `sliding_window` is None or > 0."""
    if not (0.0 < scale < math.inf):
        raise ValueError(f"scale: must be a finite number > 0, got {scale}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: must be > 0, got {sliding_window}")


def check_num_warps(num_warps: int) -> None:
    """Raise ValueError unless `num_warps` is one a Triton launch takes here: 1, 2, 4, 8 or 16."""
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps: must be 1, 2, 4, 8 or 16, got {num_warps}")


def check_same_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise ValueError unless `tensor.dtype == dtype`."""
    if tensor.dtype != dtype:
        raise ValueError(f"{name}: dtype {tensor.dtype} must match {dtype}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_KV_DTYPE = torch.float8_e4m3fn  # an FP8 KV cache's codes (`--kv-cache-dtype fp8`)
KVScales = tuple[torch.Tensor, torch.Tensor]  # (k_scale, v_scale) of an FP8 cache


def check_kv_cache_dtype(
    k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, kv_scales: KVScales | None
) -> None:
    """Raise ValueError unless the caches hold `dtype` and kv_scales is None, or hold e4m3 codes
    (FP8_KV_DTYPE) and kv_scales is (k_scale, v_scale): float32 one-element tensors on the caches' device."""
    if kv_scales is None:
        if k_cache.dtype == FP8_KV_DTYPE:
            raise ValueError(f"kv_scales: an FP8 ({FP8_KV_DTYPE}) cache is read with (k_scale, v_scale)")
        check_same_dtype("k_cache", k_cache, dtype)
        check_same_dtype("v_cache", v_cache, dtype)
        return
    if k_cache.dtype != FP8_KV_DTYPE:
        raise ValueError(
            f"kv_scales: given for a {k_cache.dtype} cache; only an FP8 ({FP8_KV_DTYPE}) one has them"
        )
    check_same_dtype("v_cache", v_cache, FP8_KV_DTYPE)
    if not isinstance(kv_scales, tuple) or len(kv_scales) != 2:
        raise ValueError(f"kv_scales: expected (k_scale, v_scale), got {type(kv_scales).__name__}")
    for name, scale in zip(("k_scale", "v_scale"), kv_scales, strict=True):
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
            raise ValueError(f"kv_scales: {name} must be a one-element tensor")
        check_same_dtype(f"kv_scales: {name}", scale, torch.float32)
        if scale.device != k_cache.device:
            raise ValueError(f"kv_scales: {name} on {scale.device}, expected {k_cache.device}")


def check_q_and_kv_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: KVScales | None = None
) -> None:
    """Raise ValueError unless q [num_tokens, num_heads, head_dim] (float) and k_cache, v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] share device and head_dim, the caches hold q's dtype
    (or e4m3 codes with kv_scales: `check_kv_cache_dtype`), and num_kv_heads divides num_heads (the
    attention kernels' GQA grouping)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_heads, head_dim = q.shape[1:]
    check_tensor("k_cache", k_cache, ndim=4, device=q.device)
    check_tensor("v_cache", v_cache, ndim=4, device=q.device)
    check_shape("v_cache", v_cache, k_cache.shape)
    check_kv_cache_dtype(k_cache, v_cache, q.dtype, kv_scales)
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache: head_dim {k_cache.shape[3]} does not match q's {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q: num_heads {num_heads} is not a multiple of k_cache's num_kv_heads {num_kv_heads}"
        )


def check_block_tables(block_tables: torch.Tensor, num_seqs: int, device: torch.device) -> None:
    """Raise ValueError unless block_tables is [num_seqs, max_blocks] int32 on `device`."""
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: {block_tables.shape[0]} rows, expected num_seqs={num_seqs}")


def output_like(name: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`out` checked to match `like` in shape, dtype and device (unit last stride), or a new empty tensor."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    check_tensor(name, out, ndim=like.dim(), device=like.device)
    check_shape(name, out, like.shape)
    check_same_dtype(name, out, like.dtype)
    return out


def checked_output(
    name: str, out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`out` checked to be 2-D `shape` and `dtype` on `device` (unit last stride), or a new empty tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, out, ndim=2, dtypes=(dtype,), device=device)
    check_shape(name, out, shape)
    return out


def check_rotary_args(positions, q, k, cos_sin_cache) -> None:
    """Raise ValueError unless q [T, num_heads, head_dim] (float, even head_dim), k [T, num_kv_heads,
    head_dim] like q, positions [T] int32/int64 and cos_sin_cache [max_position, head_dim] float32 share q's
    device: the rotary kernels' arguments."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q: head_dim {head_dim} must be even")
    check_tensor("k", k, ndim=3, device=q.device)
    check_same_dtype("k", k, q.dtype)
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k: expected [{num_tokens}, num_kv_heads, {head_dim}], got {tuple(k.shape)}")
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64, torch.int32), device=q.device)
    check_shape("positions", positions, (num_tokens,))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,), device=q.device)
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache: expected [max_position, {head_dim}], got {tuple(cos_sin_cache.shape)}"
        )


def check_store_kv_args(k, v, k_cache, v_cache, slot_mapping, kv_scales: KVScales | None = None) -> None:
    """The arguments of a K/V store (Triton `sluice.kernels.store_kv` and the C++ CPU one): k, v [num_tokens,
    num_kv_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim] in k's dtype (or e4m3
    codes with kv_scales: `check_kv_cache_dtype`); slot_mapping int64."""
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_kv_heads, head_dim = k.shape
    check_tensor("v", v, ndim=3, device=k.device)
    check_shape("v", v, k.shape)
    check_same_dtype("v", v, k.dtype)
    check_tensor("k_cache", k_cache, ndim=4, device=k.device)
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k_cache: expected [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
            f"got {tuple(k_cache.shape)}"
        )
    check_tensor("v_cache", v_cache, ndim=4, device=k.device)
    check_shape("v_cache", v_cache, k_cache.shape)
    check_kv_cache_dtype(k_cache, v_cache, k.dtype, kv_scales)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), device=k.device)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
