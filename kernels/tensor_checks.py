"""Argument checks shared by the kernel launchers: each failure is a ValueError naming the bad argument."""

from __future__ import annotations

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


def check_same_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise ValueError(f"{name}: dtype {tensor.dtype} must match {dtype}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def output_like(name: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`out` checked to match `like` in shape, dtype and device (unit last stride), or a new empty tensor."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    check_tensor(name, out, ndim=like.dim(), device=like.device)
    check_shape(name, out, like.shape)
    check_same_dtype(name, out, like.dtype)
    return out
