"""gpu_check's `mixed` section (sluice/benchmarks/gpu/mixed_step_attention.py) on the CPU, kernels
interpreted: a step of long decode rows and a prompt chunk, as one prefill launch and as served (the decode
rows through the decode kernel); small shapes and a small decode partition stand in for the GPU's."""

from __future__ import annotations

import paged_batch  # noqa: F401  (first: runs the kernels in the interpreter without CUDA)
import torch

from sluice.benchmarks.gpu import mixed_step_attention
from sluice.engine.worker.attention import triton_backend


def test_both_paths_are_timed_on_the_same_step_and_agree(monkeypatch):
    """Per shape the one-launch path runs a single prefill launch over every row, the served one the decode
    kernel on the decode rows and the prefill kernel on the chunk; their outputs agree and the rows carry
    the times the clock gave, one launch first."""
    launches = []
    for name in ("paged_decode_attention", "prefill_attention"):
        kernel = getattr(triton_backend, name)

        def spy(q, *args, _name=name, _kernel=kernel, **kwargs):
            launches.append((_name, q.shape[0]))
            return _kernel(q, *args, **kwargs)

        monkeypatch.setattr(triton_backend, name, spy)
    times = iter([0.006, 0.002, 0.003, 0.003])
    rows = mixed_step_attention.mixed_step_rows(
        torch.device("cpu"),
        shapes=((2, 80, 24), (1, 40, 16)),
        preset="tiny",
        dtype=torch.float32,
        time_s=lambda fn: (fn(), next(times))[1],
        partition_size=16,
    )
    one_launch = [("prefill_attention", 26)]
    served = [("paged_decode_attention", 2), ("prefill_attention", 24)]
    # Checked once each, then timed once each (the stand-in clock calls each path once).
    assert launches[:6] == one_launch + served + one_launch + served
    assert [row[:6] for row in rows] == [[2, 80, 24, 6.0, 2.0, 3.0], [1, 40, 16, 3.0, 3.0, 1.0]]
    assert all(row[6] <= 1e-5 for row in rows)  # float32; the two kernels sum in different orders
