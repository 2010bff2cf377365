"""Paged decode (split-KV) and varlen prefill attention kernels, and the Triton backend built on them.

Each kernel is compared with its plain PyTorch reference on random caches, with the output poisoned
(NaN) first; the references are checked once against torch's dense scaled_dot_product_attention.
Small tiles (16 x 16) make the interpreter's tiny contexts span many tiles, so every loop of the
kernels (window edge, unmasked bulk, causal diagonal; many slices per sequence) runs here; the default
tiles run too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from paged_batch import DEVICE, KERNEL_DTYPES, make_paged_batch, nan_like, tolerance

from sluice.engine.worker.attention import triton_backend as triton_backend_module
from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.kernels.paged_decode_attention import (
    DEFAULT_PARTITION_SIZE,
    MAX_SPLITS,
    PROGRAMS_PER_SM,
    DecodeConfig,
    paged_decode_attention,
    paged_decode_attention_reference,
    pick_num_splits,
)
from sluice.kernels.prefill_attention import (
    PrefillConfig,
    prefill_attention,
    prefill_attention_reference,
    prefill_config,
)
from sluice.kernels.store_kv import store_kv_reference

SCALE = 0.25
# (query_len, seq_len): fresh prefill, chunk after a cached prefix (prefix-cache hit / chunked prefill),
# decode, first-token decode, a chunk ending mid-block, a 40-token chunk after 35 cached positions.
MIXED = [(7, 7), (5, 37), (1, 20), (1, 1), (18, 50), (40, 75)]
# (num_heads, num_kv_heads, block_size): GQA ratios 1, 4, 8 over block sizes 16 and 32.
LAYOUTS = [(2, 2, 16), (8, 2, 32), (8, 1, 16), (8, 1, 32)]
SMALL_PREFILL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
SMALL_DECODE = DecodeConfig(tile_n=16, num_warps=4, num_stages=2)
DECODES = [(1, 1), (1, 17), (1, 40), (1, 63), (1, 130)]  # contexts ending mid-block, one of a single token


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


def _decode(batch, **kwargs):
    md = batch.metadata
    out = nan_like(batch.q)
    paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens, SCALE, md.max_seq_len, out=out,
        **kwargs,
    )  # fmt: skip
    return out


def _decode_reference(batch, sliding_window=None):
    md = batch.metadata
    return paged_decode_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, md.block_tables, md.seq_lens, SCALE, sliding_window
    )


def _prefill(batch, **kwargs):
    md = batch.metadata
    out = nan_like(batch.q)
    prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables,
        md.max_query_len, SCALE, out=out, **kwargs,
    )  # fmt: skip
    return out


def _prefill_reference(batch, sliding_window=None):
    md = batch.metadata
    return prefill_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables, SCALE,
        sliding_window=sliding_window,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), LAYOUTS)
def test_paged_decode_matches_reference(dtype, num_heads, num_kv_heads, block_size):
    batch = _batch(DECODES, num_heads, num_kv_heads, block_size, dtype)
    # partition_size 16 with 16-position tiles: the 130-token context is split into up to 9 slices.
    out = _decode(batch, partition_size=16, config=SMALL_DECODE)
    torch.testing.assert_close(out, _decode_reference(batch), **tolerance(dtype))


@pytest.mark.parametrize(
    ("num_splits", "layout"),
    [(n, layout) for n in (1, 2, 3, 9) for layout in (LAYOUTS[0], LAYOUTS[1], LAYOUTS[3])]
    + [(MAX_SPLITS, LAYOUTS[2])],
)
def test_split_decode_matches_reference_for_every_split_count(num_splits, layout):
    """Each sequence divides its own context among at most num_splits slices of >= 16 positions: short
    contexts use fewer slices than the grid has (the rest exit), long ones all of them."""
    num_heads, num_kv_heads, block_size = layout
    batch = _batch(DECODES, num_heads, num_kv_heads, block_size, seed=num_splits)
    out = _decode(batch, partition_size=16, num_splits=num_splits, config=SMALL_DECODE)
    torch.testing.assert_close(out, _decode_reference(batch), **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_decode_with_the_default_tiles_and_split_pick(dtype):
    batch = _batch([(1, 200), (1, 3), (1, 129)], 8, 2, 16, dtype, head_dim=32)
    # 200 positions in slices of >= 64 (one default tile): the pick for 3 x 2 programs asks for more.
    assert pick_num_splits(3, 2, 200, 132, partition_size=64) == 4
    out = _decode(batch, partition_size=64)
    torch.testing.assert_close(out, _decode_reference(batch), **tolerance(dtype))


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_paged_decode_with_a_graph_sized_grid_and_padding_rows(num_splits):
    batch = _batch([(1, 9), (1, 33), (1, 2)], 4, 2, 16, head_dim=32)
    md = batch.metadata
    seq_lens = md.seq_lens.clone()
    seq_lens[2] = 0  # a padding row with no context: output is defined as 0, never NaN
    # max_seq_len far above every context, as under a CUDA graph: idle slices must not matter.
    out = nan_like(batch.q)
    paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, md.block_tables, seq_lens, SCALE, 200, 32, out=out,
        num_splits=num_splits, config=SMALL_DECODE,
    )  # fmt: skip
    expected = paged_decode_attention_reference(
        batch.q[:2], batch.k_cache, batch.v_cache, md.block_tables[:2], seq_lens[:2], SCALE
    )
    torch.testing.assert_close(out[:2], expected, **tolerance(torch.float32))
    assert torch.equal(out[2], torch.zeros_like(out[2]))


class GridRecorder:
    """Wraps a Triton kernel: records each launch's grid and the shapes of its tensor arguments
    (`launches`), and its keyword arguments, the constexprs (`constexprs`), then runs it."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.constexprs = kernel, [], []

    @property
    def grids(self) -> list[tuple[int, ...]]:
        return [grid for grid, _ in self.launches]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            self.launches.append((grid, shapes))
            self.constexprs.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_decode_grid_and_partials_depend_on_max_seq_len_not_on_the_contexts(monkeypatch):
    """What a CUDA graph freezes at capture (grid, partial buffers) is the same for any seq_lens under
    one max_seq_len, and the partials hold at most cdiv(max_seq_len, partition_size) slices per head
    (cuda_graph_runner.estimate_graph_memory_bytes' bound)."""
    from sluice.kernels import paged_decode_attention as module

    split = GridRecorder(module._decode_partition_kernel)
    reduce = GridRecorder(module._decode_reduce_kernel)
    monkeypatch.setattr(module, "_decode_partition_kernel", split)
    monkeypatch.setattr(module, "_decode_reduce_kernel", reduce)
    batch = _batch([(1, 90), (1, 30), (1, 64)], 4, 2, 16)
    md = batch.metadata
    max_seq_len, partition_size = 128, 32
    for seq_lens in (md.seq_lens, torch.tensor([2, 1, 64], dtype=torch.int32, device=DEVICE)):
        out = nan_like(batch.q)
        paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, md.block_tables, seq_lens, SCALE, max_seq_len,
            partition_size, out=out, config=SMALL_DECODE,
        )  # fmt: skip
        expected = paged_decode_attention_reference(
            batch.q, batch.k_cache, batch.v_cache, md.block_tables, seq_lens, SCALE
        )
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    assert len(split.launches) == len(reduce.launches) == 2
    assert split.launches[0] == split.launches[1] and reduce.launches[0] == reduce.launches[1]
    grid, shapes = split.launches[0]
    num_splits = grid[2]
    assert grid == (3, 2, num_splits) and 1 < num_splits <= -(-max_seq_len // partition_size)
    assert (3, 4, num_splits, 16) in shapes and (3, 4, num_splits) in shapes  # partial outputs and LSEs


def test_pick_num_splits_fills_the_sms_only_when_the_batch_does_not():
    sms = 132
    # One sequence, 8 KV heads, long context: 8 programs alone would leave most SMs idle.
    splits = pick_num_splits(1, 8, 32768, sms)
    assert splits == -(-PROGRAMS_PER_SM * sms // 8) and splits * 8 >= PROGRAMS_PER_SM * sms
    # A batch that already has PROGRAMS_PER_SM programs per SM is not split.
    assert pick_num_splits(64, 8, 32768, sms) == 1
    assert pick_num_splits(33, 8, 4096, sms) == 1
    # In between: just enough slices.
    assert pick_num_splits(8, 8, 32768, sms) == 5
    # Never more slices than the longest context has partition_size pieces (short contexts are not
    # worth splitting; cuda_graph_runner sizes the partials by this bound), never more than MAX_SPLITS.
    assert pick_num_splits(1, 8, 1000, sms, partition_size=512) == 2
    assert pick_num_splits(1, 8, 1000, sms, partition_size=128) == 8 == pick_num_splits(1, 8, 1000, sms)
    assert pick_num_splits(1, 1, 1 << 20, sms) == MAX_SPLITS
    assert pick_num_splits(1, 1, 1 << 20, sms, max_splits=7) == 7
    assert pick_num_splits(4, 8, 1, sms) == 1
    # More SMs, more slices; an empty batch still launches a valid grid.
    assert pick_num_splits(2, 8, 32768, 2 * sms) > pick_num_splits(2, 8, 32768, sms)
    assert pick_num_splits(0, 8, 32768, sms) == 1


@pytest.mark.parametrize("max_context", [1, 15, 16, 17, 511, 512, 513, 8192, 131072])
@pytest.mark.parametrize("batch", [1, 3, 8, 64, 256])
def test_pick_num_splits_respects_the_graph_memory_bound(max_context, batch):
    splits = pick_num_splits(batch, 8, max_context, 132)
    assert 1 <= splits <= min(MAX_SPLITS, -(-max_context // DEFAULT_PARTITION_SIZE))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, 8, 100, 0), "num_sms: must be > 0"),
        ((1, 8, 100, 132, 0), "partition_size: must be > 0"),
        ((1, 8, 100, 132, 512, 0), "max_splits: must be > 0"),
    ],
)
def test_pick_num_splits_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        pick_num_splits(*args)


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), LAYOUTS)
def test_prefill_matches_reference_on_a_ragged_batch(tiles, dtype, num_heads, num_kv_heads, block_size):
    batch = _batch(MIXED, num_heads, num_kv_heads, block_size, dtype)
    out = _prefill(batch, config=SMALL_PREFILL if tiles == "small" else None)
    torch.testing.assert_close(out, _prefill_reference(batch), **tolerance(dtype))


@pytest.mark.parametrize(
    "config",
    [SMALL_PREFILL, PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)],
    ids=["one-token-of-7-heads-per-16-rows", "four-tokens-per-32-rows"],
)
def test_prefill_with_a_group_that_does_not_divide_the_tile(config):
    """14 query heads over 2 KV heads (Qwen2-0.5B's ratio, 7) and head_dim 24 (padded to 32): the tile's
    last rows hold no (token, head) pair and must not be written anywhere."""
    batch = _batch(MIXED, 14, 2, 16, head_dim=24)
    out = _prefill(batch, config=config)
    torch.testing.assert_close(out, _prefill_reference(batch), **tolerance(torch.float32))


@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), LAYOUTS)
def test_block_table_entries_one_tile_ahead_give_the_same_bits(
    num_heads, num_kv_heads, block_size, sliding_window
):
    """`prefetch_blocks` moves only where each tile's block-table entries are loaded (one tile ahead,
    carried into the next iteration), never what is computed: prefill and decode outputs equal the other
    form's bit for bit, over chunks after cached prefixes, windows and contexts of many tiles, a decode
    split in slices included; and both match the reference."""
    prefills = _batch(MIXED + [(33, 130)], num_heads, num_kv_heads, block_size)
    decodes = _batch(DECODES, num_heads, num_kv_heads, block_size)
    for run, batch, config, reference, kwargs in (
        (_prefill, prefills, SMALL_PREFILL, _prefill_reference, {}),
        (_decode, decodes, SMALL_DECODE, _decode_reference, {"num_splits": 3}),
    ):
        configs = (dataclasses.replace(config, prefetch_blocks=flag) for flag in (True, False))
        ahead, in_tile = (run(batch, config=c, sliding_window=sliding_window, **kwargs) for c in configs)
        assert torch.equal(ahead, in_tile)
        torch.testing.assert_close(ahead, reference(batch, sliding_window), **tolerance(torch.float32))


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(2, 2, 16), (8, 2, 32), (6, 3, 16)])
def test_kv_heads_interleaved_in_the_launch_give_the_same_bits(num_heads, num_kv_heads, block_size):
    """`interleave_heads` changes only which program takes which (q tile, KV head): with it and without,
    every tile of every head is computed (the output starts as NaN) bit for bit the same, over a ragged
    batch of chunks after cached prefixes, and both match the reference."""
    batch = _batch(MIXED + [(33, 130)], num_heads, num_kv_heads, block_size)
    configs = (dataclasses.replace(SMALL_PREFILL, interleave_heads=flag) for flag in (True, False))
    interleaved, by_head = (_prefill(batch, config=config) for config in configs)
    assert torch.equal(interleaved, by_head)
    torch.testing.assert_close(interleaved, _prefill_reference(batch, None), **tolerance(torch.float32))


def test_prefill_config_table():
    assert prefill_config(128, torch.bfloat16, 4, 4096) == PrefillConfig(128, 64, 8, 3)
    assert prefill_config(64, torch.float16, 1, 2048) == PrefillConfig(128, 64, 8, 3)
    assert prefill_config(128, torch.float32, 4, 4096) == PrefillConfig(64, 32, 8, 2, prefetch_blocks=False)
    assert prefill_config(256, torch.bfloat16, 2, 4096) == PrefillConfig(64, 32, 4, 2, prefetch_blocks=False)
    # Short queries: the tile shrinks to one sequence's rows, never below the group or 16.
    assert prefill_config(128, torch.bfloat16, 4, 1).block_m == 16
    assert prefill_config(128, torch.bfloat16, 4, 6).block_m == 32
    assert prefill_config(128, torch.bfloat16, 32, 1).block_m == 32


def test_references_equal_dense_causal_sdpa():
    """The paged references against torch's own attention on the same K/V laid out densely."""
    num_heads, num_kv_heads, block_size = 4, 2, 16
    batch = _batch([(6, 30), (1, 21)], num_heads, num_kv_heads, block_size)
    md = batch.metadata
    prefill = _prefill_reference(batch)
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


# Decode rows first (the scheduler's running requests), one with more context than the backends' decode
# partition below (32), then prompt chunks: the decode rows go through the decode kernel.
DECODES_FIRST = [(1, 40), (1, 130), (1, 17), (7, 7), (18, 50)]
# (pairs, block_size) of the backend comparisons: a mixed batch, a pure-decode one (the decode kernel), and
# decode rows first (both kernels).
BACKEND_BATCHES = pytest.mark.parametrize(
    ("pairs", "block_size"),
    [(MIXED, 16), ([(1, 5), (1, 37), (1, 64), (1, 16)], 32), (DECODES_FIRST, 16)],
    ids=["mixed", "pure-decode", "decodes-first"],
)


def run_triton_and_torch_backends(batch, triton_backend, torch_backend, caches, k, v, kv_scales=None):
    """Each backend's `forward` of `batch` (with k, v as the step's new K/V) over its own caches, made by
    `caches()`: {backend name: (out, k_cache, v_cache)}."""
    results = {}
    for backend in (triton_backend, torch_backend):
        k_cache, v_cache = caches()
        out = backend.forward(batch.q, k, v, k_cache, v_cache, batch.metadata, SCALE, None, kv_scales)
        results[backend.name] = (out, k_cache, v_cache)
    return results


@BACKEND_BATCHES
def test_triton_backend_equals_torch_backend(pairs, block_size):
    batch = make_paged_batch(
        [q for q, _ in pairs],
        [s for _, s in pairs],
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        block_size=block_size,
    )
    results = run_triton_and_torch_backends(
        batch,
        TritonAttentionBackend(decode_partition_size=32, prefill_partition_size=32),
        TorchAttentionBackend(),
        lambda: (batch.k_cache.clone(), batch.v_cache.clone()),
        batch.k,
        batch.v,
    )
    (triton_out, *triton_caches), (torch_out, *torch_caches) = results["triton"], results["torch"]
    torch.testing.assert_close(triton_out, torch_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(triton_caches[0], torch_caches[0])
    assert torch.equal(triton_caches[1], torch_caches[1])


def test_leading_decode_rows_are_cut_from_the_rest_of_the_batch():
    md = _batch(DECODES_FIRST, 4, 2, 16).metadata
    decodes, rest = md.leading_decodes
    assert (decodes.query_lens_cpu, decodes.seq_lens_cpu, decodes.max_seq_len) == (
        (1, 1, 1),
        (40, 130, 17),
        130,
    )
    assert decodes.query_start_loc.tolist() == [0, 1, 2, 3] and decodes.is_pure_decode
    assert torch.equal(decodes.block_tables, md.block_tables[:3])
    assert (rest.query_lens_cpu, rest.seq_lens_cpu, rest.max_query_len) == ((7, 18), (7, 50), 18)
    assert rest.query_start_loc.tolist() == [0, 7, 25] and rest.seq_lens.tolist() == [7, 50]
    assert torch.equal(rest.block_tables, md.block_tables[3:])
    assert torch.equal(rest.slot_mapping, md.slot_mapping[3:])
    # A longer query first, or decode rows only: nothing to cut.
    assert _batch(MIXED, 4, 2, 16).metadata.leading_decodes is None
    assert _batch(DECODES, 4, 2, 16).metadata.leading_decodes is None


@pytest.mark.parametrize(("partition", "split"), [(32, True), (256, False)])
def test_leading_decode_rows_over_a_partition_take_the_decode_kernel(monkeypatch, partition, split):
    """Where a leading decode row has more context than a prefill partition, those rows go to the decode
    kernel (which splits long contexts over programs) and the rest to the prefill kernel, each writing
    its rows of one output; otherwise the whole batch is one prefill launch. Both match the reference."""
    calls = []

    def spy(name):
        kernel = getattr(triton_backend_module, name)
        return lambda q, *args, **kwargs: calls.append((name, q.shape[0])) or kernel(q, *args, **kwargs)

    for name in ("paged_decode_attention", "prefill_attention"):
        monkeypatch.setattr(triton_backend_module, name, spy(name))
    batch = _batch(DECODES_FIRST, 8, 2, 16)
    out = TritonAttentionBackend(prefill_partition_size=partition).attend(
        batch.q, batch.k_cache, batch.v_cache, batch.metadata, SCALE
    )
    num_tokens = batch.q.shape[0]
    two_launches = [("paged_decode_attention", 3), ("prefill_attention", num_tokens - 3)]
    assert calls == (two_launches if split else [("prefill_attention", num_tokens)])
    torch.testing.assert_close(out, _prefill_reference(batch), **tolerance(torch.float32))


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
        ("num_splits", lambda a: 0, f"num_splits: must be in 1..{MAX_SPLITS}, got 0"),
        ("num_splits", lambda a: MAX_SPLITS + 1, f"num_splits: must be in 1..{MAX_SPLITS}"),
        ("sliding_window", lambda a: 0, "sliding_window: must be > 0"),
        ("scale", lambda a: -SCALE, "scale: must be a finite number > 0"),
        ("scale", lambda a: float("nan"), "scale: must be a finite number > 0"),
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


@pytest.mark.parametrize("scale", [0.0, -SCALE, float("inf")])
def test_prefill_rejects_a_scale_that_is_not_positive_and_finite(scale):
    # The kernels take the scale to each row's maximum score, which only a positive scale keeps.
    batch = _batch([(3, 3)], 4, 2, 16)
    md = batch.metadata
    with pytest.raises(ValueError, match=r"^scale: must be a finite number > 0"):
        prefill_attention(
            batch.q, batch.k_cache, batch.v_cache, md.query_start_loc, md.seq_lens, md.block_tables, 3, scale
        )


def test_prefill_rejects_a_tile_smaller_than_the_group():
    batch = _batch([(3, 3)], 32, 1, 16)
    with pytest.raises(ValueError, match=r"^config.block_m: 16 rows cannot hold the 32 heads"):
        _prefill(batch, config=SMALL_PREFILL)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PrefillConfig(24, 16, 4, 1), "config.block_m: must be a power of two >= 16, got 24"),
        (lambda: PrefillConfig(16, 8, 4, 1), "config.block_n: must be a power of two >= 16, got 8"),
        (lambda: PrefillConfig(16, 16, 0, 1), "config: num_warps and num_stages must be > 0"),
        (lambda: DecodeConfig(48, 4, 1), "config.tile_n: must be a power of two >= 16, got 48"),
        (lambda: DecodeConfig(16, 4, 0), "config: num_warps and num_stages must be > 0"),
    ],
)
def test_tile_configs_reject_shapes_the_kernels_cannot_run(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value).startswith(message)
