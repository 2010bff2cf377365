"""Paged attention on CPU with the C++ kernel in `kernels/cpu_paged_attention.h` (built on first use).

Each step writes the new K/V through slot_mapping (C++ `store_kv`), then one kernel call attends the whole
mixed batch (prefill chunks, chunks after a cached prefix, decodes) reading K/V in place through the block
tables, one task per (sequence, KV head, query tile) covering the GQA group. The torch backend is its
reference.
Windowed layers (Mistral, Gemma 3's local layers) pass their window to the kernel.
The launchers' argument checks run on a step's first layer only: every layer of a step passes the same
metadata and caches of one shape.
The kernel reads the model dtype: with an FP8 cache (`kv_cache_dtype`) this step's K/V are stored quantized
and the blocks the step's tables name are dequantized into a scratch cache the kernel then reads
(`sluice.engine.worker.attention.fp8_kv_cache`): a correctness path, not a speed path.
"""

from __future__ import annotations

import torch

from sluice.engine.worker.attention.fp8_kv_cache import (
    KVScales,
    backend_kv_cache_dtype,
    dequantize_blocks,
    store_fp8_kv,
)
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.kernels.cpu_extension import cpu_extension_unavailable_reason
from sluice.kernels.cpu_paged_attention import (
    EXTENSION,
    cpu_paged_attention,
    cpu_paged_attention_prechecked,
    cpu_store_kv,
    cpu_store_kv_prechecked,
)


def cpu_kernel_unavailable_reason(device: torch.device) -> str | None:
    """None when the C++ kernel can run on `device` (building it if needed), else why not."""
    if device.type != "cpu":
        return f"device: the C++ kernel runs on cpu, got {device.type!r}"
    return cpu_extension_unavailable_reason(EXTENSION)


class CpuAttentionBackend:
    """Implements `sluice.engine.worker.attention.backend.AttentionBackend` with the C++ CPU kernel."""

    name = "cpu"
    # Its tasks read a block one KV head at a time: with that head's rows contiguous (vLLM's CPU layout)
    # rather than 1 in num_kv_heads, 64 sequences' K/V at 96-200 positions took 15-19% less time cold on
    # the 2-core Zen 3 (docs/BENCHMARKS.md), the results bit for bit the same.
    kv_cache_heads_first = True

    def __init__(self, kv_cache_dtype: torch.dtype | None = None) -> None:
        """kv_cache_dtype torch.float8_e4m3fn: the caches are FP8 (None: the model dtype)."""
        self.kv_cache_dtype = backend_kv_cache_dtype(kv_cache_dtype)
        self._checked: AttentionMetadata | None = None  # the step whose arguments passed the checks

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
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        if self.kv_cache_dtype is not None:
            return self._forward_fp8(q, k, v, k_cache, v_cache, metadata, scale, sliding_window, kv_scales)
        checked = metadata is self._checked
        store = cpu_store_kv_prechecked if checked else cpu_store_kv
        store(k, v, k_cache, v_cache, metadata.slot_mapping)
        attend = cpu_paged_attention_prechecked if checked else cpu_paged_attention
        out = attend(
            q,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            scale,
            sliding_window=sliding_window,
        )
        self._checked = metadata
        return out

    def _forward_fp8(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scales: KVScales,
    ) -> torch.Tensor:
        store_fp8_kv(k, v, k_cache, v_cache, metadata.slot_mapping, kv_scales)
        keys, values, tables = dequantize_blocks(k_cache, v_cache, metadata.block_tables, kv_scales, q.dtype)
        return cpu_paged_attention(
            q,
            keys,
            values,
            tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            scale,
            sliding_window=sliding_window,
        )
