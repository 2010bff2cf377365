"""Sliding-window attention in the paged kernels and both backends: each query sees the last W positions.

Block-table entries wholly before a sequence's window point at a NaN-filled block (as a freed block
would be stale), so a kernel that reads them, even masked, returns NaN and fails. The references are
checked against torch's dense attention with transformers' sliding mask (key > query - W).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from paged_batch import DEVICE, KERNEL_DTYPES, PagedBatch, make_paged_batch, nan_like, tolerance

from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.kernels.paged_decode_attention import (
    DecodeConfig,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from sluice.kernels.prefill_attention import PrefillConfig, prefill_attention, prefill_attention_reference
from sluice.kernels.store_kv import store_kv_reference

SCALE = 0.25
WINDOW = 20
# (query_len, seq_len): a fresh prefill longer than the window, a chunk after a long prefix, a decode
# far past the window, a decode inside it, a chunk crossing several tiles.
MIXED = [(30, 30), (5, 70), (1, 90), (1, 7), (40, 75)]
DECODES = [(1, 90), (1, 7), (1, 64), (1, 21)]
# 16 x 16 tiles: the window's lower edge, the unmasked bulk and the causal diagonal each span tiles.
SMALL_PREFILL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
SMALL_DECODE = DecodeConfig(tile_n=16, num_warps=4, num_stages=2)


def _windowed_batch(pairs, num_heads=4, num_kv_heads=2, block_size=16, dtype=torch.float32) -> PagedBatch:
    """A batch whose blocks wholly before each sequence's first window point at a NaN block."""
    batch = make_paged_batch(
        [q for q, _ in pairs], [s for _, s in pairs], num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=16, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    store_kv_reference(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
    nan_block = torch.full_like(batch.k_cache[:1], float("nan"))
    k_cache, v_cache = torch.cat([batch.k_cache, nan_block]), torch.cat([batch.v_cache, nan_block])
    block_tables = batch.metadata.block_tables.clone()
    for s, (query_len, seq_len) in enumerate(pairs):
        first_visible = max(seq_len - query_len - WINDOW + 1, 0)
        block_tables[s, : first_visible // block_size] = k_cache.shape[0] - 1
    metadata = dataclasses.replace(batch.metadata, block_tables=block_tables)
    return dataclasses.replace(batch, k_cache=k_cache, v_cache=v_cache, metadata=metadata)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_windowed_decode_matches_reference_and_skips_freed_blocks(num_splits, dtype, block_size):
    batch = _windowed_batch(DECODES, block_size=block_size, dtype=dtype)
    md = batch.metadata
    out = nan_like(batch.q)
    # The window (20 positions) is split among up to 3 slices of 16; the picked count (None) and a
    # single split also run. Blocks before each window are NaN: reading one fails the comparison.
    paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens, SCALE, md.max_seq_len, 16,
        out=out, sliding_window=WINDOW, num_splits=num_splits, config=SMALL_DECODE,
    )  # fmt: skip
    expected = paged_decode_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens, SCALE, sliding_window=WINDOW
    )
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_windowed_prefill_matches_reference_and_skips_freed_blocks(tiles, dtype, block_size):
    batch = _windowed_batch(MIXED, block_size=block_size, dtype=dtype)
    md = batch.metadata
    out = nan_like(batch.q)
    prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables,
        md.max_query_len, SCALE, out=out, sliding_window=WINDOW,
        config=SMALL_PREFILL if tiles == "small" else None,
    )  # fmt: skip
    expected = prefill_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables, SCALE,
        sliding_window=WINDOW,
    )  # fmt: skip
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("window", [1, 16, 17])
def test_windows_at_tile_boundaries(window):
    """Windows of one position (each query sees itself only) and of exactly one tile or one past it."""
    pairs = [(33, 33), (6, 50), (1, 40)]
    batch = make_paged_batch(
        [q for q, _ in pairs], [s for _, s in pairs], num_heads=8, num_kv_heads=2, head_dim=16, block_size=16
    )
    store_kv_reference(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
    md = batch.metadata
    out = nan_like(batch.q)
    prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables,
        md.max_query_len, SCALE, out=out, sliding_window=window, config=SMALL_PREFILL,
    )  # fmt: skip
    expected = prefill_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables, SCALE,
        sliding_window=window,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    if window == 1:  # softmax over one position: the output is that position's V
        torch.testing.assert_close(out[:33], batch.v.repeat_interleave(4, dim=1)[:33], atol=1e-6, rtol=0)


def test_windowed_references_equal_dense_sdpa_with_the_sliding_mask():
    pairs = [(30, 70), (1, 50)]
    batch = make_paged_batch([30, 1], [70, 50], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    store_kv_reference(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
    md = batch.metadata
    prefill = prefill_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables, SCALE,
        sliding_window=WINDOW,
    )  # fmt: skip
    decode = paged_decode_attention_reference(
        batch.q[30:], batch.k_cache, batch.v_cache, md.block_tables[1:], md.seq_lens[1:], SCALE, WINDOW
    )
    for s, (rows, (query_len, seq_len)) in enumerate(zip([slice(0, 30), slice(30, 31)], pairs, strict=True)):
        positions = torch.arange(seq_len, device=DEVICE)
        blocks = md.block_tables[s, positions // 16].long()
        k = batch.k_cache[blocks, positions % 16].transpose(0, 1)  # [kv_heads, seq_len, d]
        v = batch.v_cache[blocks, positions % 16].transpose(0, 1)
        queries = torch.arange(seq_len - query_len, seq_len, device=DEVICE)[:, None]
        mask = (positions[None, :] <= queries) & (positions[None, :] > queries - WINDOW)
        q = batch.q[rows].transpose(0, 1)
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
        torch.testing.assert_close(prefill[rows], dense.transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode, prefill[30:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pairs", [MIXED, DECODES], ids=["mixed", "pure-decode"])
def test_windowed_triton_backend_equals_torch_backend(pairs):
    batch = _windowed_batch(pairs, num_heads=4, num_kv_heads=1)
    outs = {}
    for backend in (
        TritonAttentionBackend(decode_partition_size=32, prefill_partition_size=32),
        TorchAttentionBackend(),
    ):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        outs[backend.name] = backend.forward(
            batch.q, batch.k, batch.v, k_cache, v_cache, batch.metadata, SCALE, sliding_window=WINDOW
        )
    assert not outs["torch"].isnan().any()
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)


def test_windowed_torch_decode_with_tables_exactly_as_wide_as_the_longest_context():
    """input_batch sizes tables to the longest context: a window near its end must not run past it."""
    batch = _windowed_batch([(1, 90), (1, 85)], num_heads=4, num_kv_heads=1)
    md = batch.metadata
    tables = md.block_tables[:, :6]  # ceil(90 / 16) = 6 columns, no spare
    out = TorchAttentionBackend().forward(
        batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(),
        dataclasses.replace(md, block_tables=tables), SCALE, sliding_window=WINDOW,
    )  # fmt: skip
    expected = paged_decode_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, tables, md.seq_lens, SCALE, sliding_window=WINDOW
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
