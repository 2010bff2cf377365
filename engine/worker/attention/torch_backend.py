"""Paged attention in plain PyTorch: the reference backend, and the one used on CPU.

Decode rows (query_len == 1) are attended together: one gather pulls every decode sequence's context,
padded to the longest, and one masked batched attention call covers them all (faster on CPU than
gathering slots and attending with explicit matmuls: docs/BENCHMARKS.md, "Figures behind the code").
Rows with longer queries (prefill chunks) are attended one sequence at a time with a causal mask offset
by the cached prefix.

With a sliding window W, the query at position p sees positions p - W + 1 .. p; only the blocks that
hold such positions are gathered, so block-table entries before the window are never read.

With an FP8 cache (`kv_cache_dtype`), this step's K/V are stored quantized and the blocks the step's tables
name are dequantized first (`sluice.engine.worker.attention.fp8_kv_cache`); the rest is the same.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F

from sluice.engine.worker.attention.fp8_kv_cache import (
    KVScales,
    backend_kv_cache_dtype,
    dequantize_blocks,
    store_fp8_kv,
)
from sluice.engine.worker.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    """Implements `sluice.engine.worker.attention.backend.AttentionBackend` on any device; kv_cache_dtype
    torch.float8_e4m3fn: the caches are FP8 (None: the model dtype)."""

    name = "torch"
    kv_cache_heads_first = False

    def __init__(self, kv_cache_dtype: torch.dtype | None = None) -> None:
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
        if self.kv_cache_dtype is None:
            write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        else:
            k, v = store_fp8_kv(k, v, k_cache, v_cache, metadata.slot_mapping, kv_scales)
            k_cache, v_cache, tables = dequantize_blocks(
                k_cache, v_cache, metadata.block_tables, kv_scales, q.dtype
            )
            metadata = dataclasses.replace(metadata, block_tables=tables)
        if metadata.is_pure_decode:
            return decode_attention(
                q,
                k_cache,
                v_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.max_seq_len,
                scale,
                sliding_window,
            )
        return _mixed_attention(q, k, v, k_cache, v_cache, metadata, scale, sliding_window)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] -> cache slots `slot_mapping` [num_tokens]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query per sequence. q: [S, num_heads, head_dim], block_tables: [S, >= ceil(max_seq_len / bs)].

    Returns [S, num_heads, head_dim]. Context positions >= seq_lens[s] are masked out. With a sliding
    window W each sequence gathers only the ceil(W / bs) + 1 blocks from the one holding seq_len - W,
    so neither the cost nor the blocks read grow with the context.
    """
    num_seqs, block_size = q.shape[0], k_cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    columns = torch.arange(num_blocks, device=q.device)[None, :]  # [1, n]: logical block per column
    if sliding_window is not None:
        first_block = (seq_lens - sliding_window).clamp(min=0) // block_size  # [S]
        width = min(num_blocks, -(-sliding_window // block_size) + 1)
        columns = first_block[:, None] + columns[:, :width]
    # Columns past a table's end read its last entry; their positions are >= seq_len, so masked.
    index = columns.clamp(max=block_tables.shape[1] - 1).expand(num_seqs, -1)
    table = block_tables.gather(1, index)
    keys, values = _gather_context(k_cache, v_cache, table)  # [S, kv_heads, n * bs, head_dim]
    offsets = torch.arange(block_size, device=q.device)
    context = (columns[:, :, None] * block_size + offsets).flatten(1)  # [S or 1, n * bs] positions
    allowed = context < seq_lens[:, None]  # [S, L]
    if sliding_window is not None:
        allowed &= context >= (seq_lens - sliding_window)[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=allowed[:, None, None, :], scale=scale, enable_gqa=True
    )  # [S, num_heads, 1, head_dim]
    return out.view(num_seqs, q.shape[1], q.shape[2])


def _gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_tables [S, n] -> keys, values [S, num_kv_heads, n * block_size, head_dim] (strided views).

    Whole blocks are gathered (one index op each): faster on CPU than gathering slots (docs/BENCHMARKS.md).
    """
    num_seqs = block_tables.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    index = block_tables.long()
    keys = k_cache[index].view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache[index].view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    return keys, values


def _mixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Decode rows batched through `decode_attention`; each longer query attended on its own (straight
    from this step's k, v when it has no cached prefix, else over its context gathered from the cache)."""
    out = torch.empty_like(q)
    starts = list(itertools.accumulate(metadata.query_lens_cpu, initial=0))  # query_start_loc on the host
    _attend_decode_rows(out, q, k_cache, v_cache, metadata, starts, scale, sliding_window)
    for i, query_len in enumerate(metadata.query_lens_cpu):
        rows = slice(starts[i], starts[i + 1])
        window_covers_query = sliding_window is None or sliding_window >= query_len
        if query_len == metadata.seq_lens_cpu[i] > 1 and window_covers_query:
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),
                k[rows].transpose(0, 1),
                v[rows].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            ).transpose(0, 1)
        elif query_len > 1:
            out[rows] = prefill_attention(
                q[rows],
                k_cache,
                v_cache,
                metadata.block_tables[i],
                metadata.seq_lens_cpu[i],
                scale,
                sliding_window,
            )
    return out


def _attend_decode_rows(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    starts: list[int],
    scale: float,
    sliding_window: int | None,
) -> None:
    """out[row of each query_len == 1 sequence] = its decode attention, all in one batched call."""
    decode_seqs = [i for i, n in enumerate(metadata.query_lens_cpu) if n == 1]
    if not decode_seqs:
        return
    seq_index = torch.tensor(decode_seqs, device=q.device)
    token_index = torch.tensor([starts[i] for i in decode_seqs], device=q.device)
    out[token_index] = decode_attention(
        q[token_index],
        k_cache,
        v_cache,
        metadata.block_tables[seq_index],
        metadata.seq_lens[seq_index],
        max(metadata.seq_lens_cpu[i] for i in decode_seqs),
        scale,
        sliding_window,
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One sequence's query chunk q: [query_len, num_heads, head_dim], the last query_len of seq_len.

    Query j sits at position p = seq_len - query_len + j and sees context positions <= p (and, with a
    sliding window W, > p - W); gathering starts at the block holding the first query's window.
    """
    query_len, block_size = q.shape[0], k_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    first_query = seq_len - query_len
    first_block = 0 if sliding_window is None else max(first_query - sliding_window + 1, 0) // block_size
    start = first_block * block_size
    keys, values = _gather_context(k_cache, v_cache, block_table[None, first_block:num_blocks])
    keys, values = keys[0, :, : seq_len - start], values[0, :, : seq_len - start]  # [kv_heads, L, head_dim]
    context = torch.arange(start, seq_len, device=q.device)
    query_positions = torch.arange(first_query, seq_len, device=q.device)
    allowed = context[None, :] <= query_positions[:, None]  # [query_len, L]
    if sliding_window is not None:
        allowed &= context[None, :] > query_positions[:, None] - sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
    )  # [num_heads, query_len, head_dim]
    return out.transpose(0, 1)
