"""Where each rank of a tensor-parallel group runs, and whether the model splits that way, decided before any
process starts. A configuration that cannot work is refused with an error naming `tensor_parallel_size`.

    cuda   rank r on cuda:r (of the visible devices); more ranks than devices is refused
    cpu    every rank on the host, each with `num_threads` torch threads (default: this process's torch
           threads, shared out, at least 1). More ranks than CPUs is allowed, with a warning: the ranks then
           take turns on them (slower, still correct), which is how 4 ranks are tested on 2 cores.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from sluice.engine.config import EngineConfig
from sluice.engine.distributed.partition import divide, partition_heads
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.model_registry import get_model_class
from sluice.engine.worker.model_runner import pick_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """devices[r]: rank r's device; num_threads: torch threads of each rank (cpu)."""

    devices: tuple[torch.device, ...]
    num_threads: int


def place_ranks(config: EngineConfig, arch: ModelArchConfig) -> Placement:
    """The ranks' devices and threads; ValueError naming the flag when the model or the machine does not
    fit `config.parallel.tensor_parallel_size`."""
    size = config.parallel.tensor_parallel_size
    check_model_splits(arch, size)
    device = pick_device(config.model.device)
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(
                f"device: give 'cuda', not {device}: tensor-parallel ranks take cuda:0..{size - 1}"
            )
        visible = torch.cuda.device_count()
        if size > visible:
            raise ValueError(
                f"tensor_parallel_size: {size} ranks need {size} CUDA devices, {visible} visible"
            )
        return Placement(tuple(torch.device("cuda", r) for r in range(size)), 1)
    if device.type != "cpu":
        raise ValueError(f"tensor_parallel_size: ranks run on cuda or cpu devices, not {device.type}")
    cpus = len(os.sched_getaffinity(0))
    if size > cpus:
        logger.warning("%d tensor-parallel ranks on %d CPUs: the ranks take turns on them", size, cpus)
    # torch's threads in this process: its physical cores, unless set otherwise (as the core process does)
    return Placement((device,) * size, config.num_threads or max(1, torch.get_num_threads() // size))


def check_model_splits(arch: ModelArchConfig, size: int) -> None:
    """ValueError naming `tensor_parallel_size` unless the model class supports tensor parallelism and its
    query heads, KV heads and MLP columns split over `size` ranks."""
    model_class = get_model_class(arch.architecture)
    if not getattr(model_class, "supports_tensor_parallel", False):
        raise ValueError(f"tensor_parallel_size: {arch.architecture} has no tensor-parallel support; use 1")
    partition_heads(arch.num_attention_heads, arch.num_key_value_heads, 0, size)
    divide(arch.intermediate_size, size, "intermediate_size columns of the MLP")
