"""Picks the attention backend for a device by name."""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend

CUDA_ONLY_BACKENDS = ("triton", "flash-attn")


def get_attention_backend(
    name: str,
    device: torch.device,
    *,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """ "auto" -> flash-attn when it can run here, else triton on CUDA, else torch.

    flash-attn is only chosen by "auto" when `block_size` and `dtype` are given and it supports both
    (see `flash_attn_supports`). Raises ValueError for an unknown name, or for a CUDA-only backend
    that cannot run here (off CUDA, package missing, unsupported block_size or dtype).
    """
    if name not in ("auto", "torch", *CUDA_ONLY_BACKENDS):
        raise ValueError(f"attention_backend: unknown {name!r}; supported: auto, torch, triton, flash-attn")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    from engine.attention.flash_attn_backend import FlashAttnBackend, flash_attn_supports

    flash_reason = flash_attn_supports(device, block_size, dtype)
    if name == "auto" and block_size is not None and dtype is not None and flash_reason is None:
        name = "flash-attn"
    if name == "flash-attn":
        if flash_reason is not None:
            raise ValueError(f"attention_backend: 'flash-attn' cannot run: {flash_reason}")
        return FlashAttnBackend(device, block_size, dtype)
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        raise ValueError(
            f"attention_backend: 'triton' needs a CUDA device and the triton package; device is "
            f"{device.type!r}, use 'torch' or 'auto'"
        )
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
