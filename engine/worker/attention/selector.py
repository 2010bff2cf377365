"""Picks the attention backend for a device by name."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from sluice.engine.worker.attention.backend import AttentionBackend
from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)

# Built on Triton kernels (flash-attn writes the cache with store_kv): CUDA, or CPU under the interpreter.
TRITON_BACKENDS = ("triton", "flash-attn")
# Why flash-attn never reads an FP8 cache: "auto" takes triton instead, "flash-attn" is refused with it.
FP8_KV_FLASH_ATTN = (
    "kv_cache_dtype: flash-attn 2 reads bf16/fp16 pages, not an fp8 (e4m3) cache; use attention_backend "
    "'triton' (what 'auto' picks)"
)
# Logged (INFO) when triton takes an FP8 cache: the GPU check's report looks for it in the server's log.
FP8_KV_TRITON_NOTE = "kv_cache_dtype fp8: the triton attention backend reads the e4m3 cache in its kernels"


def triton_can_run(device: torch.device) -> bool:
    """Triton kernels compile for CUDA; on CPU they only run in Triton's interpreter (slow: tests)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def get_attention_backend(
    name: str,
    device: torch.device,
    *,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """ "auto" -> flash-attn when it can run here, else triton on CUDA; on CPU the C++ kernel ("cpu"),
    or torch with a logged warning when it cannot be built (no compiler). "auto" never picks the
    interpreter; "triton" on CPU runs it when TRITON_INTERPRET=1.

    flash-attn is only chosen by "auto" when `block_size` and `dtype` are given and it supports both
    (see `flash_attn_supports`). An FP8 cache (`kv_cache_dtype` torch.float8_e4m3fn) is read by the torch,
    cpu and triton backends, not by flash-attn (`FP8_KV_FLASH_ATTN`): "auto" on CUDA then picks triton.
    Raises ValueError for an unknown name, for a CUDA-only backend that cannot run here (off CUDA, package
    missing, unsupported block_size or dtype; flash-attn with an FP8 cache), or for "cpu" off CPU or
    without its compiled kernel.
    """
    if name not in ("auto", "torch", "cpu", *TRITON_BACKENDS):
        raise ValueError(
            f"attention_backend: unknown {name!r}; supported: auto, torch, cpu, triton, flash-attn"
        )
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        return _cpu_backend(name, device, kv_cache_dtype)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend(kv_cache_dtype)
    from sluice.engine.worker.attention.flash_attn_backend import FlashAttnBackend, flash_attn_supports

    flash_reason = FP8_KV_FLASH_ATTN if kv_cache_dtype is not None else None
    flash_reason = flash_reason or flash_attn_supports(device, block_size, dtype)
    if name == "auto" and block_size is not None and dtype is not None and flash_reason is None:
        name = "flash-attn"
    if name == "flash-attn":
        if flash_reason is not None:
            raise ValueError(f"attention_backend: 'flash-attn' cannot run: {flash_reason}")
        return FlashAttnBackend(device, block_size, dtype)
    if not triton_can_run(device):
        raise ValueError(
            f"attention_backend: 'triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU) and the "
            f"triton package; device is {device.type!r}, use 'torch' or 'auto'"
        )
    from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend

    if kv_cache_dtype is not None:
        logger.info(FP8_KV_TRITON_NOTE)
    return TritonAttentionBackend(kv_cache_dtype=kv_cache_dtype)


def _cpu_backend(name: str, device: torch.device, kv_cache_dtype: torch.dtype | None) -> AttentionBackend:
    """The C++ CPU backend; for "auto", the torch backend (logged) when the kernel cannot be built."""
    from sluice.engine.worker.attention.cpu_backend import CpuAttentionBackend, cpu_kernel_unavailable_reason

    reason = cpu_kernel_unavailable_reason(device)
    if reason is None:
        return CpuAttentionBackend(kv_cache_dtype)
    if name == "cpu":
        raise ValueError(f"attention_backend: 'cpu' cannot run: {reason}")
    logger.warning("attention_backend auto: using the torch backend on cpu: %s", reason)
    return TorchAttentionBackend(kv_cache_dtype)
