"""Paged decode and varlen prefill attention kernels, and the Triton backend built on them.

Each kernel is compared with its plain PyTorch reference on random caches, with the output poisoned
(NaN) first; the references are checked once against torch's dense scaled_dot_product_attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_batch import DEVICE, TEST_DTYPES, make_paged_batch, nan_like, tolerance

from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
from sluice.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from sluice.kernels.store_kv import store_kv_reference

SCALE = 0.25
# (query_len, seq_len): fresh prefill, chunk after a cached prefix (prefix-cache hit / chunked prefill),
# decode, first-token decode, a 2-tile chunk ending mid-block.
MIXED = [(7, 7), (5, 37), (1, 20), (1, 1), (18, 50)]
# (num_heads, num_kv_heads, block_size): GQA ratios 1, 4, 8 over block sizes 16 and 32.
LAYOUTS = [(2, 2, 16), (8, 2, 32), (8, 1, 16), (8, 1, 32)]
PREFILL_LAYOUTS = LAYOUTS[:3]  # the prefill kernel runs one program per head: fewer cases keep it fast


def _batch(pairs, num_heads, num_kv_heads, block_size, dtype=torch.float32, head_dim=16, seed=0):
    batch = make_paged_batch(
        [q for q, _ in pairs],
        [s for _, s in pairs],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )
    # The kernels read the new tokens' K/V from the cache, as the backend leaves them after store_kv.
    store_kv_reference(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
    return batch


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), LAYOUTS)
def test_paged_decode_matches_reference(dtype, num_heads, num_kv_heads, block_size):
    pairs = [(1, 1), (1, 17), (1, 40), (1, 63)]  # contexts ending mid-block, one of a single token
    batch = _batch(pairs, num_heads, num_kv_heads, block_size, dtype)
    md = batch.metadata
    out = nan_like(batch.q)
    # partition_size 16 splits the 63-token context into 4 partitions combined by the reduce kernel.
    paged_decode_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        md.block_tables,
        md.seq_lens,
        SCALE,
        md.max_seq_len,
        16,
        out=out,
    )
    expected = paged_decode_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens, SCALE
    )
    torch.testing.assert_close(out, expected, **tolerance(dtype))


def test_paged_decode_with_a_graph_sized_grid_and_padding_rows():
    batch = _batch([(1, 9), (1, 33), (1, 2)], 4, 2, 16, head_dim=32)
    md = batch.metadata
    seq_lens = md.seq_lens.clone()
    seq_lens[2] = 0  # a padding row with no context: output is defined as 0, never NaN
    # max_seq_len far above every context, as under a CUDA graph: idle partitions must not matter.
    out = nan_like(batch.q)
    paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, md.block_tables, seq_lens, SCALE, 200, 32, out=out
    )
    expected = paged_decode_attention_reference(
        batch.q[:2], batch.k_cache, batch.v_cache, md.block_tables[:2], seq_lens[:2], SCALE
    )
    torch.testing.assert_close(out[:2], expected, **tolerance(torch.float32))
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), PREFILL_LAYOUTS)
def test_prefill_matches_reference_on_a_mixed_batch(dtype, num_heads, num_kv_heads, block_size):
    batch = _batch(MIXED, num_heads, num_kv_heads, block_size, dtype)
    md = batch.metadata
    out = nan_like(batch.q)
    prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables,
        md.max_query_len, SCALE, out=out,
    )  # fmt: skip
    expected = prefill_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables, SCALE
    )
    torch.testing.assert_close(out, expected, **tolerance(dtype))


def test_references_equal_dense_causal_sdpa():
    """The paged references against torch's own attention on the same K/V laid out densely."""
    num_heads, num_kv_heads, block_size = 4, 2, 16
    batch = _batch([(6, 30), (1, 21)], num_heads, num_kv_heads, block_size)
    md = batch.metadata
    prefill = prefill_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables, SCALE
    )
    decode = paged_decode_attention_reference(
        batch.q[6:], batch.k_cache, batch.v_cache, md.block_tables[1:], md.seq_lens[1:], SCALE
    )
    for s, (rows, seq_len) in enumerate([(slice(0, 6), 30), (slice(6, 7), 21)]):
        positions = torch.arange(seq_len, device=DEVICE)
        blocks = md.block_tables[s, positions // block_size].long()
        k = batch.k_cache[blocks, positions % block_size].transpose(0, 1)  # [kv_heads, seq_len, d]
        v = batch.v_cache[blocks, positions % block_size].transpose(0, 1)
        q = batch.q[rows].transpose(0, 1)
        query_len = q.shape[1]
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=DEVICE).tril(seq_len - query_len)
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
        torch.testing.assert_close(prefill[rows], dense.transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode, prefill[6:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("pairs", "block_size"),
    [(MIXED, 16), ([(1, 5), (1, 37), (1, 64), (1, 16)], 32)],
    ids=["mixed", "pure-decode"],
)
def test_triton_backend_equals_torch_backend(pairs, block_size):
    batch = make_paged_batch(
        [q for q, _ in pairs],
        [s for _, s in pairs],
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        block_size=block_size,
    )
    caches = {}
    outs = {}
    for backend in (TritonAttentionBackend(decode_partition_size=32), TorchAttentionBackend()):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        outs[backend.name] = backend.forward(
            batch.q, batch.k, batch.v, k_cache, v_cache, batch.metadata, SCALE
        )
        caches[backend.name] = (k_cache, v_cache)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches["triton"][0], caches["torch"][0])
    assert torch.equal(caches["triton"][1], caches["torch"][1])


def _decode_args():
    batch = _batch([(1, 5), (1, 9)], 4, 2, 16)
    md = batch.metadata
    return {
        "q": batch.q,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "block_tables": md.block_tables,
        "seq_lens": md.seq_lens,
        "scale": SCALE,
        "max_seq_len": 9,
    }


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("q", lambda a: a["q"].double(), "q: dtype torch.float64"),
        ("q", lambda a: torch.randn(2, 3, 16), "q: num_heads 3 is not a multiple"),
        ("k_cache", lambda a: a["k_cache"].half(), "k_cache: dtype torch.float16 must match"),
        ("block_tables", lambda a: a["block_tables"].long(), "block_tables: dtype torch.int64"),
        ("block_tables", lambda a: a["block_tables"][:1], "block_tables: 1 rows, expected num_seqs=2"),
        ("seq_lens", lambda a: a["seq_lens"][:1], "seq_lens: expected shape (2,)"),
        ("out", lambda a: torch.empty(2, 4, 8), "out: expected shape (2, 4, 16)"),
        ("partition_size", lambda a: 24, "partition_size: 24 must be a positive multiple of 16"),
    ],
)
def test_paged_decode_rejects_bad_arguments_naming_them(name, bad, message):
    args = _decode_args()
    value = bad(args)
    args[name] = value.to(DEVICE) if isinstance(value, torch.Tensor) else value
    with pytest.raises(ValueError) as err:
        paged_decode_attention(**args)
    assert str(err.value).startswith(message)


def test_prefill_rejects_bad_query_start_loc():
    batch = _batch([(3, 3), (2, 9)], 4, 2, 16)
    md = batch.metadata
    with pytest.raises(ValueError, match=r"^query_start_loc: expected shape \(3,\)"):
        prefill_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            md.query_start_loc[:2],
            md.seq_lens,
            md.block_tables,
            3,
            SCALE,
        )
