"""The interface every attention backend (torch reference, Triton, flash-attn) implements."""

from __future__ import annotations

from typing import Protocol

import torch

from sluice.engine.worker.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache, then attends over the cache.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], unit stride on head_dim; with
        kv_cache_heads_first the cache is laid out [num_blocks, num_kv_heads, block_size, head_dim] under that
        shape (a transposed view), so a block's rows of one KV head are contiguous
    sliding_window: None, or W: the query at position p attends to positions p - W + 1 .. p only (block
        table entries wholly before that may have been freed and must not be read)
    kv_scales: (k_scale, v_scale) of an FP8 cache (`kv_cache_dtype` torch.float8_e4m3fn), else None
        (`sluice.engine.worker.attention.fp8_kv_cache`)
    returns: [num_tokens, num_heads, head_dim]
    """

    name: str
    kv_cache_heads_first: bool
    kv_cache_dtype: torch.dtype | None  # None: the model dtype

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
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...
