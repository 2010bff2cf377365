"""A mixed step's attention (gpu_check's `mixed` section): decode rows with long contexts first, as the
scheduler orders running requests, then a fresh prompt chunk, through `TritonAttentionBackend.attend`.
Timed two ways on the same inputs: as served (the decode rows through the decode kernel, which splits
their contexts over programs, the chunk through the prefill kernel: two launches) and as one prefill
launch for the whole batch (the backend's path for decode rows within a prefill partition), where each decode
row's (sequence, KV head) walks its whole context in one program. Rows: both times, the speedup and the
outputs' max relative difference (more than `MIXED_MAX_REL_DIFF` apart fails the section).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sluice.benchmarks.gpu.gpu_benchmarks import (
    BLOCK_SIZE,
    decode_requests,
    relative_difference,
    time_kernel_s,
)
from sluice.engine.loading.presets import preset_arch
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.engine.worker.input_batch import build_model_inputs
from sluice.kernels.prefill_splits import PREFILL_PARTITION_SIZE

# (decode rows, each one's context, the prompt chunk's tokens): a few long agent contexts decoding while
# a new request's prompt arrives, and one such row beside a bigger chunk.
MIXED_SHAPES = ((4, 32768, 512), (1, 8192, 2048))
MIXED_MAX_REL_DIFF = 1e-2  # bf16 outputs of two kernels that sum in different orders
ONE_LAUNCH_PARTITION = 1 << 20  # a prefill partition no context reaches: the backend's one prefill launch


def mixed_step_rows(
    device: torch.device,
    shapes: Sequence[tuple[int, int, int]] = MIXED_SHAPES,
    preset: str = "llama-3.2-1b",
    dtype: torch.dtype = torch.bfloat16,
    time_s: Callable[[Callable[[], object]], float] = time_kernel_s,
    partition_size: int = PREFILL_PARTITION_SIZE,
) -> list[list[object]]:
    """Per shape: (decode rows, context, prompt tokens, one launch ms, as served ms, speedup, max rel diff
    of the outputs), `preset`'s heads, random unit-normal q and K/V; served with prefill partitions of
    `partition_size` (contexts must be longer, or both paths are the one launch)."""
    arch = preset_arch(preset)
    rows = []
    for num_decodes, context, prompt_len in shapes:
        metadata = _mixed_metadata(num_decodes, context, prompt_len, device)
        num_blocks = int(metadata.block_tables.max()) + 1
        shape = (num_blocks, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
        k_cache = torch.randn(shape, dtype=dtype, device=device)
        q = torch.randn(num_decodes + prompt_len, arch.num_attention_heads, arch.head_dim, dtype=dtype,
                        device=device)  # fmt: skip
        single_s, split_s, difference = _time_both_paths(
            q, k_cache, torch.randn_like(k_cache), metadata, time_s, partition_size
        )
        rows.append([num_decodes, context, prompt_len, single_s * 1e3, split_s * 1e3, single_s / split_s,
                     difference])  # fmt: skip
    return rows


def _time_both_paths(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    time_s: Callable[[Callable[[], object]], float],
    partition_size: int,
) -> tuple[float, float, float]:
    """(seconds as one prefill launch, seconds as served, the outputs' max relative difference)."""
    scale = q.shape[-1] ** -0.5
    one_launch, served = (
        lambda backend=backend: backend.attend(q, k_cache, v_cache, metadata, scale)
        for backend in (
            TritonAttentionBackend(prefill_partition_size=ONE_LAUNCH_PARTITION),
            TritonAttentionBackend(prefill_partition_size=partition_size),
        )
    )
    single = one_launch()
    difference = relative_difference(served(), single)
    return time_s(one_launch), time_s(served), difference


def _mixed_metadata(
    num_decodes: int, context: int, prompt_len: int, device: torch.device
) -> AttentionMetadata:
    """The step's metadata: `num_decodes` decode rows of `context` tokens on disjoint blocks, then one fresh
    prompt of `prompt_len` tokens on the blocks after theirs."""
    decodes = decode_requests(num_decodes, context, BLOCK_SIZE)
    first = num_decodes * -(-context // BLOCK_SIZE)
    prompt_blocks = tuple(range(first, first + -(-prompt_len // BLOCK_SIZE)))
    prompt = ScheduledRequest("prompt", (1,) * prompt_len, 0, prompt_blocks, sample=True)
    output = SchedulerOutput((*decodes, prompt), num_decodes + prompt_len)
    return build_model_inputs(output, BLOCK_SIZE, device).metadata
