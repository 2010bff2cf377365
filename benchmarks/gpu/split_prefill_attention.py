"""Split-KV prefill attention (gpu_check's `split_prefill` section): short queries after long contexts, the
shapes where the prefill kernel has few q tiles x KV heads for the GPU's SMs: speculative verify rows at
batch 1 and 4, a short turn after a long cached conversation (a prefix-cache hit), a chunk after a long
prefix. Timed three ways on the same inputs: one program per (q tile, KV head) walking the whole context
(num_splits 1, the kernel before split-KV), as served (`pick_prefill_splits`' count, then the partials'
merge) and with twice that count (whether the pick's bar, PREFILL_PROGRAMS_PER_SM programs an SM, is
too low; run 15 raised it from one to two). Rows: the picked count, the times, the speedups over one
split and the outputs' max relative difference (more than `SPLIT_MAX_REL_DIFF` apart fails the section).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sluice.benchmarks.gpu.gpu_benchmarks import BLOCK_SIZE, relative_difference, time_kernel_s
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.presets import preset_arch
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.input_batch import build_model_inputs
from sluice.kernels.paged_decode_attention import MAX_SPLITS
from sluice.kernels.prefill_attention import prefill_attention, prefill_config
from sluice.kernels.prefill_splits import PREFILL_PARTITION_SIZE, pick_prefill_splits

# (sequences, query tokens each, context each, query tokens included): verify rows of 3 drafts + 1 at
# batch 1 over 32k and at batch 4 over 8k, a 128-token turn after 16k cached, a 512-token chunk after 32k.
SPLIT_SHAPES = ((1, 4, 32768), (4, 4, 8192), (1, 128, 16384), (1, 512, 32768))
SPLIT_MAX_REL_DIFF = 1e-2  # bf16 outputs summed in different orders


def split_prefill_rows(
    device: torch.device,
    shapes: Sequence[tuple[int, int, int]] = SPLIT_SHAPES,
    preset: str = "llama-3.2-1b",
    dtype: torch.dtype = torch.bfloat16,
    time_s: Callable[[Callable[[], object]], float] = time_kernel_s,
    partition_size: int = PREFILL_PARTITION_SIZE,
) -> list[list[object]]:
    """Per shape: (sequences, query tokens, context, picked splits, one split ms, picked ms, its speedup,
    twice the splits ms, its speedup, max rel diff of the picked's outputs), `preset`'s heads, random
    unit-normal q and K/V."""
    arch = preset_arch(preset)
    heads, kv_heads, head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    rows = []
    for num_seqs, query_len, context in shapes:
        md = _metadata(num_seqs, query_len, context, device)
        k_cache = torch.randn(int(md.block_tables.max()) + 1, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype,
                              device=device)  # fmt: skip
        q = torch.randn(num_seqs * query_len, heads, head_dim, dtype=dtype, device=device)
        args = (q, k_cache, torch.randn_like(k_cache), md.query_start_loc, md.seq_lens, md.block_tables,
                md.max_query_len, head_dim**-0.5)  # fmt: skip
        num_splits = _picked_splits(num_seqs, query_len, context, arch, dtype, partition_size, device)
        whole, split, double = (
            lambda args=args, kwargs=kwargs: prefill_attention(*args, partition_size=partition_size, **kwargs)
            for kwargs in (
                {"num_splits": 1},
                {"max_seq_len": md.max_seq_len},
                {"num_splits": min(2 * num_splits, MAX_SPLITS)},
            )
        )
        difference = relative_difference(split(), whole())
        whole_s, split_s, double_s = time_s(whole), time_s(split), time_s(double)
        rows.append([num_seqs, query_len, context, num_splits, whole_s * 1e3, split_s * 1e3,
                     whole_s / split_s, double_s * 1e3, whole_s / double_s, difference])  # fmt: skip
    return rows


def _picked_splits(
    num_seqs: int,
    query_len: int,
    context: int,
    arch: ModelArchConfig,
    dtype: torch.dtype,
    partition_size: int,
    device: torch.device,
) -> int:
    """The split count the launcher picks for the shape (`pick_prefill_splits` over its q tiles)."""
    queries_per_kv = arch.num_attention_heads // arch.num_key_value_heads
    config = prefill_config(arch.head_dim, dtype, queries_per_kv, query_len)
    return pick_prefill_splits(
        num_seqs * query_len, num_seqs, query_len, arch.num_key_value_heads, config.block_m // queries_per_kv,
        config.block_n, context, None, partition_size, device,
    )  # fmt: skip


def _metadata(num_seqs: int, query_len: int, context: int, device: torch.device) -> AttentionMetadata:
    """`num_seqs` requests computing their last `query_len` of `context` positions, on disjoint blocks."""
    blocks = -(-context // BLOCK_SIZE)
    requests = tuple(
        ScheduledRequest(f"r{i}", (1,) * query_len, context - query_len,
                         tuple(range(i * blocks, (i + 1) * blocks)), sample=True)
        for i in range(num_seqs)
    )  # fmt: skip
    return build_model_inputs(SchedulerOutput(requests, num_seqs * query_len), BLOCK_SIZE, device).metadata
