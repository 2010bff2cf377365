"""Paged attention with the Triton kernels in `kernels/` (CUDA, or CPU under TRITON_INTERPRET=1).

Each step: `store_kv` writes the new K/V through slot_mapping, then `attend`:
    pure-decode batch (every query_len == 1)  -> `paged_decode_attention` (split-KV flash-decoding,
                                                  GQA-grouped; the split count is picked per launch
                                                  from batch x KV heads vs the SM count)
    any batch with a longer query              -> `prefill_attention` (FlashAttention-2 style varlen,
                                                  causal, GQA heads packed per tile, over the paged
                                                  cache; its decode rows are query_len == 1 sequences;
                                                  split-KV when its q tiles are too few for the GPU)
    ... that starts with decode rows, one of   -> those rows through `paged_decode_attention`, the rest
        them over a prefill partition (512)       through `prefill_attention`, into one output
A pure-decode batch reads only tensors and `max_query_len` / `max_seq_len`, never the `*_cpu` tuples, so
its step can be captured in a CUDA graph (the decode grid and partial buffers depend only on the batch
size, max_seq_len and the device). A batch with a longer query reads `query_lens_cpu` and `seq_lens_cpu`
to find leading decode rows (`AttentionMetadata.leading_decodes`); the captured ones of that kind,
speculative verify rows of one length, have none, so their launches never depend on them.

`rotate_and_store` + `attend` is the fused alternative to rotary + `forward`: one kernel rotates q and k
in place and writes k, v into the cache. Every layer takes it when its rotation is the Triton kernel's
(`sluice.engine.worker.layers.attention.Attention`).

With an FP8 cache (`kv_cache_dtype` float8_e4m3fn, `sluice.engine.worker.attention.fp8_kv_cache`) the
store kernels write e4m3 codes of k / k_scale and v / v_scale, and the attention kernels dequantize each
tile in registers to the model dtype; the layer's scales (float32 0-dim tensors) are read by the kernels
on the device, so nothing is synced to the host and a captured graph replays them.
"""

from __future__ import annotations

import torch

from sluice.engine.worker.attention.fp8_kv_cache import KVScales, backend_kv_cache_dtype
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.kernels.paged_decode_attention import DEFAULT_PARTITION_SIZE, DecodeConfig, paged_decode_attention
from sluice.kernels.prefill_attention import prefill_attention
from sluice.kernels.prefill_splits import PREFILL_PARTITION_SIZE
from sluice.kernels.rotary_store_kv import rotary_store_kv
from sluice.kernels.store_kv import store_kv


class TritonAttentionBackend:
    """Implements `sluice.engine.worker.attention.backend.AttentionBackend` with Triton kernels.

    `decode_partition_size` is the shortest context slice one decode program takes; the decode kernel never
    makes more than cdiv(max_seq_len, decode_partition_size) slices per head, as
    `cuda_graph_runner.estimate_graph_memory_bytes` counts them. `prefill_partition_size` is the shortest
    slice one prefill program takes where the prefill kernel splits, and the context a mixed step's leading
    decode rows must exceed (one of them) to take the decode kernel rather than the prefill launch.
    `decode_config` is the decode kernel's tile (None: `decode_config`'s table). kv_cache_dtype
    torch.float8_e4m3fn: the caches are FP8 and every call takes the layer's kv_scales (None: the model dtype,
    no scales).
    """

    name = "triton"
    kv_cache_heads_first = False

    def __init__(
        self,
        decode_partition_size: int = DEFAULT_PARTITION_SIZE,
        kv_cache_dtype: torch.dtype | None = None,
        decode_config: DecodeConfig | None = None,
        prefill_partition_size: int = PREFILL_PARTITION_SIZE,
    ) -> None:
        self.decode_partition_size = decode_partition_size
        self.prefill_partition_size = prefill_partition_size
        self.decode_config = decode_config
        self.kv_cache_dtype = backend_kv_cache_dtype(kv_cache_dtype)

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
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping, kv_scales)
        return self.attend(q, k_cache, v_cache, metadata, scale, sliding_window, kv_scales)

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: KVScales | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k in place by `positions` and store k, v at metadata.slot_mapping (one kernel);
        follow with `attend`. Returns (q, k)."""
        return rotary_store_kv(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, metadata.slot_mapping, kv_scales
        )

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        """Attention of q over the cache, which already holds this step's K/V."""

        def decode(q: torch.Tensor, md: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
            # One query row per sequence, so q's rows are the sequences in order.
            return paged_decode_attention(
                q, k_cache, v_cache, md.block_tables, md.seq_lens, scale, max_seq_len=md.max_seq_len,
                partition_size=self.decode_partition_size, out=out, sliding_window=sliding_window,
                config=self.decode_config, kv_scales=kv_scales,
            )  # fmt: skip

        def prefill(q: torch.Tensor, md: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
            return prefill_attention(
                q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len,
                scale, out=out, sliding_window=sliding_window, kv_scales=kv_scales,
                max_seq_len=md.max_seq_len, partition_size=self.prefill_partition_size,
            )  # fmt: skip

        if metadata.is_pure_decode:
            return decode(q, metadata)
        split = metadata.leading_decodes
        if split is None or split[0].max_seq_len <= self.prefill_partition_size:
            return prefill(q, metadata)
        # Decode rows with more context than a prefill partition, then longer queries: the decode kernel
        # splits those contexts over programs, where the prefill kernel would walk each (sequence, KV head)'s
        # whole context in one program while the rest of the GPU waits.
        decodes, rest = split
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = decodes.num_seqs
        decode(q[:num_decodes], decodes, out[:num_decodes])
        prefill(q[num_decodes:], rest, out[num_decodes:])
        return out
