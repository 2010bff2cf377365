"""`DecodeConfig(fused_reduce=True)`: the last slice of each (sequence, KV head) to finish merges the slices
in the split kernel, and no reduce kernel runs. Under the interpreter its outputs are the reduce launch's bit
for bit (the same merge, `_merge_slices`; on a GPU within a few rounding steps) and the PyTorch reference's
within tolerance; the counters it counts on are left zero for the next launch; where it has no counters
(more units than `SPLIT_COUNTERS`, or a graph captured before any launch allocated them) the reduce kernel
runs as before. The memory ordering between the programs (each slice's partials stored before its count,
read after the last count) is the split-K fused reduce's (`sluice.kernels.split_k.add_splits_if_last`) and
needs a GPU to exercise: these tests run in the GPU check's kernel tests too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_batch import DEVICE, KERNEL_DTYPES, make_paged_batch, nan_like, tolerance
from test_kernels_attention import GridRecorder

from sluice.engine.worker.attention.fp8_kv_cache import quantize_kv
from sluice.kernels import paged_decode_attention as decode_module
from sluice.kernels import split_k
from sluice.kernels.paged_decode_attention import (
    DecodeConfig,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from sluice.kernels.store_kv import store_kv_reference

SCALE = 0.25
SMALL = DecodeConfig(tile_n=16, num_warps=4, num_stages=2)
FUSED = dataclasses.replace(SMALL, fused_reduce=True)
# Contexts ending mid-block, one of a single token, one of none (a CUDA graph's padding row: output 0).
CONTEXTS = [1, 17, 40, 0, 63, 130]
# (num_heads, num_kv_heads, block_size): GQA ratios 1, 4, 8.
LAYOUTS = [(2, 2, 16), (8, 2, 32), (8, 1, 16)]


@pytest.fixture
def launches(monkeypatch):
    """(split launches, reduce launches) of `paged_decode_attention`, recorded."""
    split = GridRecorder(decode_module._decode_partition_kernel)
    reduce = GridRecorder(decode_module._decode_reduce_kernel)
    monkeypatch.setattr(decode_module, "_decode_partition_kernel", split)
    monkeypatch.setattr(decode_module, "_decode_reduce_kernel", reduce)
    return split, reduce


def _batch(num_heads, num_kv_heads, block_size, dtype, seed=0):
    seq_lens = [max(length, 1) for length in CONTEXTS]  # the empty one is cut to 0 below
    batch = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16,
        block_size=block_size, dtype=dtype, seed=seed,
    )  # fmt: skip
    store_kv_reference(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
    seq_lens = batch.metadata.seq_lens.clone()
    seq_lens[CONTEXTS.index(0)] = 0
    return batch, seq_lens


def _decode(batch, seq_lens, config, kv_scales=None, k_cache=None, v_cache=None, **kwargs):
    md = batch.metadata
    out = nan_like(batch.q)
    paged_decode_attention(
        batch.q, batch.k_cache if k_cache is None else k_cache, batch.v_cache if v_cache is None else v_cache,
        md.block_tables, seq_lens, SCALE, 200, partition_size=16, out=out, config=config,
        kv_scales=kv_scales, **kwargs,
    )  # fmt: skip
    return out


def _assert_merged_alike(fused: torch.Tensor, unfused: torch.Tensor) -> None:
    """The interpreter: the same bits (the same merge code). Compiled into another kernel on a GPU the
    merge may round a few steps apart (another FMA contraction), so there four steps of the dtype: a slice
    merged before it was stored, or left out, moves an output by far more."""
    if DEVICE.type == "cpu":
        assert torch.equal(fused, unfused)
    else:
        steps = 4 * torch.finfo(fused.dtype).eps
        torch.testing.assert_close(fused, unfused, rtol=steps, atol=steps)


def _counters_zero(device: torch.device) -> bool:
    """The fused launches' counters on `device` (a tensor's: cuda:0, not cuda) exist and are all 0."""
    counters = split_k._split_counters.get(device)
    return counters is not None and not counters.any()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), LAYOUTS)
@pytest.mark.parametrize("num_splits", [None, 3, 9])
def test_the_last_slice_merges_as_the_reduce_launch_does(
    dtype, num_heads, num_kv_heads, block_size, num_splits, launches
):
    batch, seq_lens = _batch(num_heads, num_kv_heads, block_size, dtype, seed=num_splits or 0)
    split, reduce = launches
    # another batch's partials first, so that memory the fused launch's partials reuse holds other values
    _decode(dataclasses.replace(batch, q=-batch.q), seq_lens, SMALL, num_splits=num_splits)
    fused = _decode(batch, seq_lens, FUSED, num_splits=num_splits)
    assert (len(split.launches), len(reduce.launches)) == (2, 1)  # no reduce launch
    unfused = _decode(batch, seq_lens, SMALL, num_splits=num_splits)
    _assert_merged_alike(fused, unfused)
    assert _counters_zero(batch.q.device)
    md = batch.metadata
    reference = paged_decode_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, md.block_tables, seq_lens, SCALE
    )
    empty = CONTEXTS.index(0)
    assert torch.equal(fused[empty], torch.zeros_like(fused[empty]))
    torch.testing.assert_close(fused, reference, **tolerance(dtype))


def test_with_a_window_and_an_fp8_cache(launches):
    batch, seq_lens = _batch(8, 2, 16, torch.bfloat16, seed=4)
    scales = torch.tensor(0.05, device=DEVICE), torch.tensor(0.1, device=DEVICE)
    caches = {
        "k_cache": quantize_kv(batch.k_cache, scales[0]),
        "v_cache": quantize_kv(batch.v_cache, scales[1]),
    }
    for kwargs in ({"sliding_window": 20}, {"kv_scales": scales, **caches}):
        unfused = _decode(batch, seq_lens, SMALL, **kwargs)
        fused = _decode(batch, seq_lens, FUSED, **kwargs)
        _assert_merged_alike(fused, unfused)
        assert not fused.isnan().any()
    assert len(launches[1].launches) == 2  # the unfused calls' reduce launches only
    assert _counters_zero(batch.q.device)


def test_without_counters_the_reduce_kernel_runs(monkeypatch, launches):
    """More (sequence, KV head) units than SPLIT_COUNTERS: the split kernel keeps its partials and the
    reduce launch merges them, as without fused_reduce."""
    batch, seq_lens = _batch(8, 2, 16, torch.float32)
    unfused = _decode(batch, seq_lens, SMALL)
    monkeypatch.setattr(split_k, "SPLIT_COUNTERS", len(CONTEXTS) * 2 - 1)
    fused = _decode(batch, seq_lens, FUSED)
    assert len(launches[1].launches) == 2 and torch.equal(fused, unfused)  # both merged by the reduce launch
