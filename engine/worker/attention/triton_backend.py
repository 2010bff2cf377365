"""Paged attention with the Triton kernels in `kernels/` (CUDA, or CPU under TRITON_INTERPRET=1).

Each step: `store_kv` writes the new K/V through slot_mapping, then
    pure-decode batch (every query_len == 1)  -> `paged_decode_attention` (flash-decoding, GQA-grouped)
    any batch with a longer query              -> `prefill_attention` (varlen, causal, over the paged cache;
                                                  its decode rows are just query_len == 1 sequences)
Only tensors and `max_query_len` / `max_seq_len` are read, never the `*_cpu` tuples, so a decode step
can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.kernels.paged_decode_attention import DEFAULT_PARTITION_SIZE, paged_decode_attention
from sluice.kernels.prefill_attention import prefill_attention
from sluice.kernels.store_kv import store_kv


class TritonAttentionBackend:
    """Implements `sluice.engine.worker.attention.backend.AttentionBackend` with Triton kernels."""

    name = "triton"
    kv_cache_heads_first = False

    def __init__(self, decode_partition_size: int = DEFAULT_PARTITION_SIZE) -> None:
        self.decode_partition_size = decode_partition_size

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if metadata.is_pure_decode:
            # One query row per sequence, so q's rows are the sequences in order.
            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                max_seq_len=metadata.max_seq_len,
                partition_size=self.decode_partition_size,
                sliding_window=sliding_window,
            )
        return prefill_attention(
            q,
            k_cache,
            v_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.max_query_len,
            scale,
            sliding_window=sliding_window,
        )
