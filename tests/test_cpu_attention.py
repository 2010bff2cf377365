"""The C++ CPU paged-attention kernel against its PyTorch reference, and the "cpu" backend built on it
against the torch reference backend, on random mixed batches with the output poisoned (NaN) first.

Batches mix fresh prefills, chunks after a cached prefix (one longer than a 16-row query tile), decodes and
first-token decodes, with contexts ending mid-block; GQA ratios 1, 3, 4, 8; block sizes 8, 16 and 32; with
and without a sliding window (the blocks before a window poisoned, so reading one fails the test).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from paged_batch import PagedBatch, make_paged_batch, nan_like

from sluice.engine.worker.attention.cpu_backend import CpuAttentionBackend
from sluice.engine.worker.attention.selector import get_attention_backend
from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.kernels import cpu_extension
from sluice.kernels.cpu_paged_attention import cpu_paged_attention, cpu_paged_attention_reference
from sluice.kernels.store_kv import store_kv_reference

CPU = torch.device("cpu")
SCALE = 0.125
# (query_len, seq_len)
MIXED = [(7, 7), (5, 37), (1, 20), (1, 1), (21, 50), (1, 33), (3, 64)]
PURE_DECODE = [(1, 1), (1, 17), (1, 40), (1, 63), (1, 32)]
GQA = [(4, 4), (9, 3), (8, 2), (8, 1)]  # (num_heads, num_kv_heads): ratios 1, 3, 4, 8
BLOCK_SIZES = [8, 16, 32]
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _cpu_batch(pairs, num_heads, num_kv_heads, block_size, *, dtype=torch.float32, head_dim=64, seed=0):
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
    md = batch.metadata
    metadata = dataclasses.replace(
        md,
        **{f: getattr(md, f).cpu() for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")},
    )
    tensors = {f: getattr(batch, f).cpu() for f in ("q", "k", "v", "k_cache", "v_cache")}
    return PagedBatch(**tensors, metadata=metadata)


def _heads_first(cache: torch.Tensor) -> torch.Tensor:
    """The same cache laid out as the engine allocates it for the CPU backend: a block's rows of one KV head
    together, under the same [num_blocks, block_size, num_kv_heads, head_dim] shape."""
    laid_out = cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert laid_out.stride(1) == cache.shape[3]  # slot to slot within a head: one row
    return laid_out


def _kernel_args(batch: PagedBatch) -> dict:
    md = batch.metadata
    return {
        "q": batch.q,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "block_tables": md.block_tables,
        "query_start_loc": md.query_start_loc,
        "seq_lens": md.seq_lens,
        "scale": SCALE,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("pairs", [MIXED, PURE_DECODE], ids=["mixed", "pure-decode"])
@pytest.mark.parametrize("heads_first", [False, True], ids=["slot-major", "heads-first"])
def test_kernel_matches_reference(heads_first, pairs, num_heads, num_kv_heads, block_size, dtype):
    batch = _cpu_batch(pairs, num_heads, num_kv_heads, block_size, dtype=dtype, seed=block_size + num_heads)
    md = batch.metadata
    store_kv_reference(batch.k, batch.v, batch.k_cache, batch.v_cache, md.slot_mapping)
    expected = cpu_paged_attention_reference(**_kernel_args(batch))
    if heads_first:
        batch = dataclasses.replace(
            batch, k_cache=_heads_first(batch.k_cache), v_cache=_heads_first(batch.v_cache)
        )
    out = nan_like(batch.q)
    got = cpu_paged_attention(**_kernel_args(batch), out=out)
    assert got is out
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("head_dim", [16, 80, 128])
def test_kernel_handles_other_head_dims_and_strided_q(head_dim):
    batch = _cpu_batch(MIXED, 8, 2, 16, head_dim=head_dim, seed=head_dim)
    store_kv_reference(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
    # q as a view into a fused qkv projection: rows strided, heads packed.
    qkv = torch.randn(batch.q.shape[0], 12 * head_dim)
    qkv[:, : 8 * head_dim] = batch.q.reshape(batch.q.shape[0], -1)
    args = _kernel_args(batch) | {"q": qkv[:, : 8 * head_dim].view(-1, 8, head_dim)}
    out = nan_like(batch.q)
    cpu_paged_attention(**args, out=out)
    torch.testing.assert_close(
        out, cpu_paged_attention_reference(**_kernel_args(batch)), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("head_dim", [64, 16])  # the vector path and the scalar one
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 20, 100])
def test_kernel_with_a_sliding_window_matches_reference_and_skips_blocks_before_it(
    window, block_size, head_dim
):
    batch = _cpu_batch(MIXED, 9, 3, block_size, head_dim=head_dim, seed=window + block_size)
    md = batch.metadata
    store_kv_reference(batch.k, batch.v, batch.k_cache, batch.v_cache, md.slot_mapping)
    expected = cpu_paged_attention_reference(**_kernel_args(batch), sliding_window=window)
    # Blocks wholly before every query row's window (a windowed cache may have freed them): NaN, never read.
    poisoned = 0
    for s, (query_len, seq_len) in enumerate(MIXED):
        for index in range(max(0, seq_len - query_len - window + 1) // block_size):
            block = int(md.block_tables[s, index])
            batch.k_cache[block], batch.v_cache[block] = float("nan"), float("nan")
            poisoned += 1
    out = cpu_paged_attention(**_kernel_args(batch), out=nan_like(batch.q), sliding_window=window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert poisoned > 0 or window >= 50


def test_kernel_rejects_a_window_below_one():
    args = _kernel_args(_cpu_batch([(3, 3), (1, 9)], 4, 2, 16))
    with pytest.raises(ValueError, match="sliding_window: must be > 0 or None, got 0"):
        cpu_paged_attention(**args, sliding_window=0)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("pairs", [MIXED, PURE_DECODE], ids=["mixed", "pure-decode"])
def test_cpu_backend_equals_torch_backend(pairs, num_heads, num_kv_heads, block_size, window):
    batch = _cpu_batch(pairs, num_heads, num_kv_heads, block_size, seed=7)
    outs, caches = {}, {}
    for backend in (CpuAttentionBackend(), TorchAttentionBackend()):
        # Each gets its cache laid out as the engine allocates it for that backend.
        laid_out = _heads_first if backend.kv_cache_heads_first else torch.clone
        k_cache, v_cache = laid_out(batch.k_cache), laid_out(batch.v_cache)
        outs[backend.name] = backend.forward(
            batch.q, batch.k, batch.v, k_cache, v_cache, batch.metadata, SCALE, sliding_window=window
        )
        caches[backend.name] = (k_cache, v_cache)
    torch.testing.assert_close(outs["cpu"], outs["torch"], atol=2e-5, rtol=2e-5)
    assert torch.equal(caches["cpu"][0], caches["torch"][0])
    assert torch.equal(caches["cpu"][1], caches["torch"][1])


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("q", lambda a: a["q"].double(), "q: dtype torch.float64"),
        ("q", lambda a: torch.randn(a["q"].shape[0], 3, 64), "q: num_heads 3 is not a multiple"),
        ("k_cache", lambda a: a["k_cache"].bfloat16(), "k_cache: dtype torch.bfloat16 must match"),
        ("k_cache", lambda a: a["k_cache"].transpose(1, 2), "v_cache: expected shape"),
        ("block_tables", lambda a: a["block_tables"].long(), "block_tables: dtype torch.int64"),
        ("block_tables", lambda a: a["block_tables"][:1], "block_tables: 1 rows, expected num_seqs=2"),
        ("seq_lens", lambda a: a["seq_lens"].long(), "seq_lens: dtype torch.int64"),
        ("query_start_loc", lambda a: a["query_start_loc"][:2], "query_start_loc: 2 entries"),
        ("query_start_loc", lambda a: a["query_start_loc"] - 1, "query_start_loc: must run from 0"),
    ],
)
def test_kernel_rejects_bad_arguments_naming_them(name, bad, message):
    args = _kernel_args(_cpu_batch([(3, 3), (1, 9)], 4, 2, 16))
    args[name] = bad(args)
    with pytest.raises(ValueError) as err:
        cpu_paged_attention(**args)
    assert str(err.value).startswith(message)


def test_kernel_rejects_a_block_table_too_short_for_the_context():
    args = _kernel_args(_cpu_batch([(3, 3), (1, 9)], 4, 2, 16))
    args["seq_lens"] = torch.tensor([3, 40], dtype=torch.int32)  # 3 blocks, the table has 2 columns
    with pytest.raises(RuntimeError, match="block_tables: sequence 1 needs 3 blocks, the table has 2"):
        cpu_paged_attention(**args)


def test_auto_on_cpu_picks_the_cpu_kernel():
    assert get_attention_backend("auto", CPU, block_size=16, dtype=torch.float32).name == "cpu"
    assert get_attention_backend("cpu", CPU).name == "cpu"
    with pytest.raises(
        ValueError, match=r"^attention_backend: 'cpu' cannot run: device: the C\+\+ kernel runs on cpu"
    ):
        get_attention_backend("cpu", torch.device("cuda"))


@pytest.fixture
def no_compiler(monkeypatch):
    """As on a machine without a C++ compiler: the build is retried and refused."""
    monkeypatch.setenv("CXX", "sluice-no-such-compiler")
    cpu_extension._build.cache_clear()
    cpu_extension._warn_once.cache_clear()
    yield
    monkeypatch.undo()
    cpu_extension._build.cache_clear()
    cpu_extension._warn_once.cache_clear()


def test_without_a_compiler_auto_falls_back_to_torch_with_a_warning(no_compiler, caplog):
    with caplog.at_level(logging.WARNING):
        assert get_attention_backend("auto", CPU).name == "torch"
    assert (
        "attention_backend auto: using the torch backend on cpu: "
        "no C++ compiler ('sluice-no-such-compiler' not found on PATH)"
    ) in caplog.messages
    with pytest.raises(ValueError, match=r"^attention_backend: 'cpu' cannot run: no C\+\+ compiler"):
        get_attention_backend("cpu", CPU)


@pytest.mark.parametrize("bad", [-1, "num_blocks", 100_000_000])
def test_kernel_rejects_a_block_id_outside_the_cache(bad):
    """The kernel read any id a table held: NaN or another request's rows, and past the cache SIGSEGV."""
    args = _kernel_args(_cpu_batch([(3, 3), (1, 9)], 4, 2, 16))
    num_blocks = args["k_cache"].shape[0]
    block_id = num_blocks if bad == "num_blocks" else bad
    args["block_tables"] = args["block_tables"].clone()
    args["block_tables"][1, 0] = block_id
    with pytest.raises(
        ValueError, match=rf"^block_tables: sequence 1 block 0 is {block_id}, not one of the cache's"
    ):
        cpu_paged_attention(**args)
