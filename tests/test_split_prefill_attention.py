"""gpu_check's `split_prefill` section (sluice/benchmarks/gpu/split_prefill_attention.py) on the CPU, kernels
interpreted: short queries after long contexts through the prefill kernel in one split and in the split
count the launcher picks; small shapes and a small partition stand in for the GPU's."""

from __future__ import annotations

import paged_batch  # noqa: F401  (first: runs the kernels in the interpreter without CUDA)
import torch
from test_kernels_attention import GridRecorder

import sluice.kernels.prefill_attention as prefill_module
from sluice.benchmarks.gpu import split_prefill_attention


def test_the_three_ways_are_timed_on_the_same_inputs_and_agree(monkeypatch):
    """Per shape the kernel runs in the picked split count (> 1 here: the row says which) and in one split,
    their outputs agree, and the rows carry the times the clock gave: one split, the picked count, twice
    the picked count."""
    recorder = GridRecorder(prefill_module._prefill_attention_kernel)
    monkeypatch.setattr(prefill_module, "_prefill_attention_kernel", recorder)
    times = iter([0.006, 0.002, 0.003, 0.003, 0.003, 0.001])
    rows = split_prefill_attention.split_prefill_rows(
        torch.device("cpu"),
        shapes=((1, 4, 80), (2, 3, 40)),
        preset="tiny",
        dtype=torch.float32,
        time_s=lambda fn: (fn(), next(times))[1],
        partition_size=16,
    )
    splits = [row[3] for row in rows]
    assert all(count > 1 for count in splits)
    # Checked once (split, then one split), then timed once each way (one split, picked, twice).
    assert [grid[1] for grid in recorder.grids] == [
        *(splits[0], 1, 1, splits[0], 2 * splits[0]),
        *(splits[1], 1, 1, splits[1], 2 * splits[1]),
    ]
    assert [row[:3] + row[4:9] for row in rows] == [
        [1, 4, 80, 6.0, 2.0, 3.0, 3.0, 2.0],
        [2, 3, 40, 3.0, 3.0, 1.0, 1.0, 3.0],
    ]
    assert all(row[9] <= 1e-5 for row in rows)  # float32; the slices are summed in another order
