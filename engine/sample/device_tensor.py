"""Host values as a tensor on a device, without waiting for the device's queue."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_tensor(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host values on `device` (`to_device_no_wait`)."""
    return to_device_no_wait(torch.tensor(values, dtype=dtype), device)


def to_device_no_wait(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. On CUDA through pinned memory with a non-blocking copy:
    `torch.tensor(values, device=cuda)` and `.to(cuda)` copy from pageable memory, which waits for the
    device's queue (under async scheduling, for the forward just launched)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
