"""What a launch on a device compiles for and how wide the device is: the launchers' choices that depend on
the GPU's compute capability (`store_kv.gpu_e4m3`, `dependent_launch.dependent_launch`) and on its SM count
(split counts, tiles a launch fills the GPU with); and the warps for a program holding a row's columns."""

from __future__ import annotations

import functools
import os

import torch


def compiles_for_capability(device: torch.device, capability: tuple[int, int]) -> bool:
    """Whether launches on `device` compile for a GPU of at least `capability`: a CUDA device of one, or no
    GPU outside the interpreter (the ahead-of-time compiles of scripts/compile_kernels.py, sm_90 unless told
    otherwise). False under TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_capability(index) >= capability
    return True


@functools.lru_cache(maxsize=16)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


DEFAULT_NUM_SMS = 132  # an H100 SXM's SM count: used to size launches when not on a CUDA device


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; DEFAULT_NUM_SMS elsewhere (interpreter, AOT compile)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_NUM_SMS


@functools.lru_cache(maxsize=16)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def warps_for_columns(columns: int, most: int) -> int:
    """Warps for a program holding `columns` values of a row: one warp per 256 of them, 1 to `most` (Triton's
    layer-norm tutorial's rule, there up to 8; the row-wise launchers' choice, untuned)."""
    return max(1, min(most, columns // 256))
