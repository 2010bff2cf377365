"""gpu_check's `step_kernels` section (sluice/benchmarks/gpu/graph_step_kernels.py): the batch-1 graph step
profiled kernel by kernel. On the CPU the runner runs eagerly and the profile holds CPU operators; the
section's arithmetic on device kernels is checked on a summary in the profiler's format."""

from __future__ import annotations

import paged_batch  # noqa: F401  (first: runs the kernels in the interpreter without CUDA)
import pytest
import torch

from sluice.benchmarks.gpu.graph_step_kernels import (
    GraphStepProfile,
    profile_graph_steps,
    step_kernels_figures,
    step_kernels_text,
)
from sluice.engine.loading.presets import preset_arch

LINEARS_PER_LAYER = 4  # qkv, o, gate_up, down (merged as the loader merges them)


def test_each_graph_is_timed_then_profiled_over_its_steps_alone():
    """Per graph, the timing clock's figure and a profile of exactly `steps` steps of that graph: every
    layer's linears and the lm_head once a step (not the unprofiled warm-up's, nor the timing's)."""
    timed = []

    def time_s(fn):
        fn()
        timed.append(fn)
        return 0.004 * len(timed)

    profiles = profile_graph_steps(
        torch.device("cpu"), preset="tiny", context=48, graph_contexts=(64, 256), steps=3, time_s=time_s
    )
    linears = LINEARS_PER_LAYER * preset_arch("tiny").num_hidden_layers + 1
    assert [(p.graph_context, p.step_s) for p in profiles] == [(64, 0.004), (256, 0.008)]
    for profile in profiles:
        summary = profile.summary
        assert (summary["steps"], summary["rows_per_step"], summary["measured"]) == (3, [1, 1, 1], "cpu")
        counts = {entry["name"]: entry["count"] for entry in summary["top"]}
        assert counts["aten::linear"] == 3 * linears
        assert counts["aten::embedding"] == 3
        assert profile.device_s == 0 and profile.launches == 0
        assert "device_busy_us_total" not in summary  # nothing ran on a device
    text = step_kernels_text(profiles, floor_s=0.002)
    assert "| 64 | 4.0 | - | - | - | 2.0 |" in text  # no device: no kernel figures
    assert text.count("CPU only (no device)") == 2


def _entry(name: str, count: int, device_us: float, on_device: bool = True) -> dict:
    return {
        "name": name,
        "count": count,
        "self_device_us": device_us,
        "self_cpu_us": 1.0,
        "on_device": on_device,
    }


def test_device_kernels_give_the_step_its_kernel_time_launches_and_the_rest():
    """Over 4 steps: 3 kernels a step taking 600 us between them; the graph step timed at 1 ms leaves 0.4
    ms between kernels; CPU operators (the graph launch) count in neither."""
    summary = {
        "steps": 4,
        "rows_per_step": [1] * 4,
        "wall_s": 0.01,
        "measured": "device",
        "device_us_total": 2400.0,
        "cpu_us_total": 50.0,
        "top": [
            _entry("gemv_bf16", 8, 1600.0),
            _entry("cudaGraphLaunch", 4, 0.0, on_device=False),
            _entry("rms_norm_kernel", 4, 800.0),
        ],
    }
    profile = GraphStepProfile(512, 0.001, summary)
    assert (profile.device_s, profile.launches) == (600e-6, 3.0)
    assert profile.totals_row(0.0005) == [512, 1.0, 0.6, 0.4, 3.0, 2.0]
    assert profile.totals_row(None)[-1] == "-"
    text = step_kernels_text([profile], floor_s=None)
    assert "| `gemv_bf16` | 400.0 | 66.7% | 2 |" in text
    assert "cudaGraphLaunch" not in text
    figures = step_kernels_figures([profile])["graphs"][0]
    assert figures["kernels"] == [
        {"name": "gemv_bf16", "launches": 2.0, "us": 400.0},
        {"name": "rms_norm_kernel", "launches": 1.0, "us": 200.0},
    ]
    assert (figures["step_s"], figures["launches"]) == (0.001, 3.0)


def test_kernels_overlapping_under_pdl_count_once_in_the_kernel_time_and_the_rest():
    """Over 2 steps the kernels' durations sum to 1.2 ms a step, but the norm launched under programmatic
    dependent launch waited 400 us a step inside for the GEMV: the device was busy 0.8 ms of the 1 ms step,
    so 0.2 ms is between kernels (the durations' sum left none)."""
    summary = {
        "steps": 2,
        "rows_per_step": [1] * 2,
        "wall_s": 0.01,
        "measured": "device",
        "device_us_total": 2400.0,
        "device_busy_us_total": 1600.0,
        "device_overlap_us": 800.0,
        "cpu_us_total": 50.0,
        "top": [
            _entry("rms_norm_kernel", 2, 1000.0) | {"exclusive_device_us": 200.0},
            _entry("gemv_bf16", 2, 1400.0) | {"exclusive_device_us": 1400.0},
        ],
    }
    profile = GraphStepProfile(512, 0.001, summary)
    assert profile.device_s == 800e-6
    graph_context, *figures, by_floor = profile.totals_row(None)
    assert (graph_context, by_floor) == (512, "-") and figures == pytest.approx([1.0, 0.8, 0.2, 2.0])
    text = step_kernels_text([profile], floor_s=None)
    assert "device busy 800 us a step" in text
    assert "| `gemv_bf16` | 700.0 | 87.5% | 1 |\n| `rms_norm_kernel` | 100.0 | 12.5% | 1 |" in text
    assert step_kernels_figures([profile])["graphs"][0]["kernels"] == [
        {"name": "gemv_bf16", "launches": 1.0, "us": 700.0},
        {"name": "rms_norm_kernel", "launches": 1.0, "us": 100.0},
    ]
