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
from sluice.engine.loading.fp8_config import resolve_fp8_config
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.model_registry import get_model_class
from sluice.engine.worker.layers.quantization import unsupported_reason
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
    check_model_splits(arch, size, config.model.fp8_weight_block)
    if config.model.quantization in ("int4", "int8"):
        check_quantized_splits(arch, size, config.model.quantization)
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


def check_model_splits(arch: ModelArchConfig, size: int, weight_block: int | None = None) -> None:
    """ValueError naming `tensor_parallel_size` unless the model class supports tensor parallelism and its
    query heads, KV heads and MLP columns split over `size` ranks (and, block-wise FP8 from the checkpoint or
    made at load in `weight_block`s, its weight blocks)."""
    model_class = get_model_class(arch.architecture)
    if not getattr(model_class, "supports_tensor_parallel", False):
        raise ValueError(f"tensor_parallel_size: {arch.architecture} has no tensor-parallel support; use 1")
    heads = partition_heads(arch.num_attention_heads, arch.num_key_value_heads, 0, size)
    mlp_columns = divide(arch.intermediate_size, size, "intermediate_size columns of the MLP")
    if size == 1 or ("quantization_config" not in arch.extra and weight_block is None):
        return
    quantization = None if weight_block is None else "fp8"
    fp8 = resolve_fp8_config(quantization, arch.extra, model_class.packed_modules, weight_block=weight_block)
    # projection -> (a rank's rows, a rank's input columns); 0: not split that way
    parts = {
        "self_attn.qkv_proj": (heads.num_kv_heads * arch.head_dim, 0),  # q rows: a multiple of these
        "self_attn.o_proj": (0, heads.num_heads * arch.head_dim),
        "mlp.gate_up_proj": (mlp_columns, 0),
        "mlp.down_proj": (0, mlp_columns),
    }
    for layer in range(arch.num_hidden_layers):
        for projection, (rows, columns) in parts.items():
            scheme = fp8.scheme_for(f"model.layers.{layer}.{projection}")
            if scheme is None or scheme.block is None:
                continue
            for what, count, block in (
                ("rows", rows, scheme.block[0]),
                ("input columns", columns, scheme.block[1]),
            ):
                if count % block:
                    raise ValueError(
                        f"tensor_parallel_size: {size} ranks would cut the FP8 weight blocks of {projection} "
                        f"({count} {what} a rank, blocks of {block})"
                    )


def check_quantized_splits(arch: ModelArchConfig, size: int, method: str) -> None:
    """ValueError naming `tensor_parallel_size` when a rank's part of a projection is a shape `method` (int4:
    its 32-column groups, its 16-row packs; int8: 16-column input steps) cannot quantize though the whole
    projection is one it can (the quantizer's own error, at load on every rank, named a size no config
    holds)."""
    heads = partition_heads(arch.num_attention_heads, arch.num_key_value_heads, 0, size)
    mlp_columns, hidden, head_dim = arch.intermediate_size // size, arch.hidden_size, arch.head_dim
    num_qkv_heads = arch.num_attention_heads + 2 * arch.num_key_value_heads
    # projection -> ((rows, input columns) whole, (rows, input columns) of a rank)
    parts = {
        "self_attn.qkv_proj": (
            (num_qkv_heads * head_dim, hidden),
            ((heads.num_heads + 2 * heads.num_kv_heads) * head_dim, hidden),
        ),
        "self_attn.o_proj": (
            (hidden, arch.num_attention_heads * head_dim),
            (hidden, heads.num_heads * head_dim),
        ),
        "mlp.gate_up_proj": ((2 * arch.intermediate_size, hidden), (2 * mlp_columns, hidden)),
        "mlp.down_proj": ((hidden, arch.intermediate_size), (hidden, mlp_columns)),
    }
    cpu = torch.device("cpu")
    for projection, ((rows, columns), (rank_rows, rank_columns)) in parts.items():
        if unsupported_reason(method, columns, rows, cpu) is not None:
            continue  # not a split's doing: the quantizer says why at load
        if (reason := unsupported_reason(method, rank_columns, rank_rows, cpu)) is not None:
            raise ValueError(
                f"tensor_parallel_size: {size} ranks leave each a part of {projection} that {method} cannot "
                f"quantize ({rank_rows} rows x {rank_columns} input columns: {reason})"
            )
