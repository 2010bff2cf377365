"""Paged attention with the `flash_attn` package (CUDA only); importing this module never needs it.

flash-attn 2 reads a paged cache through `block_table` only when the page (our block_size) is a
multiple of 256 tokens, and only in float16 / bfloat16; `flash_attn_supports` states both limits
so the selector can fall back to the Triton backend instead of failing at the first step.
"""

from __future__ import annotations

import importlib.util

import torch

from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.kernels.store_kv import store_kv

FLASH_ATTN_PAGE_MULTIPLE = 256
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_installed() -> bool:
    """True when the `flash_attn` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_supports(
    device: torch.device, block_size: int | None, dtype: torch.dtype | None
) -> str | None:
    """None when flash-attn can run here; otherwise the reason it cannot (naming the field)."""
    if device.type != "cuda":
        return f"device: flash-attn needs a CUDA device, got {device.type!r}"
    if not flash_attn_installed():
        return "attention_backend: the flash_attn package is not installed (pip install 'sluice[gpu]')"
    if block_size is not None and block_size % FLASH_ATTN_PAGE_MULTIPLE:
        return f"block_size: flash-attn needs a multiple of {FLASH_ATTN_PAGE_MULTIPLE}, got {block_size}"
    if dtype is not None and dtype not in FLASH_ATTN_DTYPES:
        return f"dtype: flash-attn needs float16 or bfloat16, got {dtype}"
    return None


class FlashAttnBackend:
    """Implements `sluice.engine.worker.attention.backend.AttentionBackend` with flash_attn's paged-KV
    kernels.

    K/V are written by the Triton `store_kv` kernel; decode batches use `flash_attn_with_kvcache`,
    mixed batches `flash_attn_varlen_func`, both reading the cache through `block_tables`.
    """

    name = "flash-attn"
    kv_cache_heads_first = False
    kv_cache_dtype = None  # an FP8 cache is refused by the selector (its kernels read the model dtype)

    def __init__(self, device: torch.device, block_size: int | None = None, dtype: torch.dtype | None = None):
        reason = flash_attn_supports(device, block_size, dtype)
        if reason is not None:
            raise ValueError(reason)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

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
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        # flash-attn's window (left, right) counts keys before the query: W positions = W - 1 to its left.
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        if metadata.is_pure_decode:
            out = self._with_kvcache(
                q.unsqueeze(1),  # [num_seqs, 1, num_heads, head_dim]
                k_cache,
                v_cache,
                cache_seqlens=metadata.seq_lens,
                block_table=metadata.block_tables,
                softmax_scale=scale,
                causal=True,
                window_size=window,
            )
            return out.squeeze(1)
        cu_seqlens_k = torch.zeros_like(metadata.query_start_loc)  # [num_seqs + 1] int32
        cu_seqlens_k[1:] = torch.cumsum(metadata.seq_lens, dim=0, dtype=torch.int32)
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=window,
            block_table=metadata.block_tables,
        )
