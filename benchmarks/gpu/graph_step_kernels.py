"""Where the batch-1 CUDA-graph decode step's time goes, kernel by kernel (gpu_check's `step_kernels`
section): the step is timed (CUDA events, `time_cuda_s`), then replayed under torch.profiler, whose
kernels CUPTI reports one by one from the graph. Per graph: the step's time, the kernels' device time a
step, the rest (the device idle between kernels: inside the graph, and around the replay's launch and the
logits' launches after it, which run eagerly) and the table of kernels. The kernels' time is the device's
busy time, the union of their intervals, not their sum: under programmatic dependent launch a kernel is
launched while the one before it still runs and waits inside for it to end, so the kernels of one stream
overlap, and their sum would overstate the kernels and understate the rest. The table gives each kernel its
exclusive time (`step_profiler.exclusive_us`), and those sum to the busy time. Issue 33's 1b batch-1
graph step is 2.24x its weight-bytes floor (run 12); this says whether what is left is in the linears, in
the small kernels or between kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sluice.benchmarks.gpu.gpu_benchmarks import (
    BENCH_CONTEXT,
    SERVED_GRAPH_CONTEXT,
    time_batch1_graph_steps,
    time_cuda_s,
)
from sluice.benchmarks.gpu.markdown_table import markdown_table
from sluice.benchmarks.gpu.step_profiles import busy_us, kernel_us, profile_table
from sluice.engine.core.step_profiler import device_us, summarize

PROFILED_STEPS = 20  # graph replays under the profiler, per graph
TABLE_KERNELS = 24  # rows of each graph's table (a llama layer launches ~10 kernels, ~12 distinct names)


@dataclass(frozen=True)
class GraphStepProfile:
    graph_context: int  # the longest context the graph was captured for
    step_s: float  # timed without the profiler
    summary: dict[str, Any]  # `step_profiler.summarize` over PROFILED_STEPS replays

    @property
    def device_s(self) -> float:
        """The device's busy time a step, kernels overlapping under programmatic dependent launch counted
        once (their durations' sum in a summary without it; 0 where nothing ran on a device)."""
        return busy_us(self.summary) / 1e6 / max(1, self.summary["steps"])

    @property
    def kernels(self) -> list[dict[str, Any]]:
        """The summary's device entries (kernels), longest first (by exclusive time where it has it)."""
        kernels = [entry for entry in self.summary["top"] if entry["on_device"]]
        return sorted(kernels, key=kernel_us, reverse=True)

    @property
    def launches(self) -> float:
        """Kernels launched a step (by the graph and after it)."""
        return sum(entry["count"] for entry in self.kernels) / max(1, self.summary["steps"])

    def totals_row(self, floor_s: float | None) -> list[object]:
        """(graph for, step ms, kernels ms, the rest ms, launches, step / floor) for the totals table; "-"
        for the kernels' figures where nothing ran on a device."""
        step_ms, device_ms = self.step_s * 1e3, self.device_s * 1e3
        by_floor = self.step_s / floor_s if floor_s else "-"
        if self.summary["measured"] != "device":
            return [self.graph_context, step_ms, "-", "-", "-", by_floor]
        return [self.graph_context, step_ms, device_ms, step_ms - device_ms, self.launches, by_floor]


def profile_calls(fn: Callable[[], object], calls: int, device: torch.device) -> dict[str, Any]:
    """`calls` calls of `fn` under torch.profiler (CPU, and CUDA on a GPU), after one unprofiled call:
    the summary `step_profiler.summarize` gives, one step a call."""
    on_cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if on_cuda else []
    fn()
    if on_cuda:
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profiler:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        if on_cuda:
            torch.cuda.synchronize(device)  # every call's kernels end inside the profile
        wall_s = time.perf_counter() - started
    averages = profiler.key_averages()
    on_device = any(device_us(entry) > 0 for entry in averages)
    return summarize(averages, [1] * calls, wall_s, on_device, profiler.events())


def profile_graph_steps(
    device: torch.device,
    preset: str = "llama-3.2-1b",
    context: int = BENCH_CONTEXT,
    graph_contexts: Sequence[int] = (BENCH_CONTEXT, SERVED_GRAPH_CONTEXT),
    steps: int = PROFILED_STEPS,
    time_s: Callable[[Callable[[], object]], float] = time_cuda_s,
) -> list[GraphStepProfile]:
    """The batch-1 graph step of `preset` (random bf16 weights, default kernels) at a `context`-token
    context, in a graph captured for each of `graph_contexts` positions: timed, then profiled."""
    summaries = []

    def timed_then_profiled(fn: Callable[[], object]) -> float:
        seconds = time_s(fn)
        summaries.append(profile_calls(fn, steps, device))
        return seconds

    variants = [(lambda kernels: kernels, graph_context) for graph_context in graph_contexts]
    _, timings = time_batch1_graph_steps(device, preset, context, variants, timed_then_profiled)
    return [
        GraphStepProfile(graph_context, seconds, summary)
        for graph_context, (seconds, _), summary in zip(graph_contexts, timings, summaries, strict=True)
    ]


def step_kernels_text(profiles: Sequence[GraphStepProfile], floor_s: float | None) -> str:
    """The section's markdown: a row of totals per graph (against the weight-bytes floor where known), then
    each graph's kernel table."""
    headers = ["graph for (positions)", "graph step ms", "kernels ms a step", "rest ms (between kernels)",
               "launches a step", "step / floor"]  # fmt: skip
    rows = [p.totals_row(floor_s) for p in profiles]
    tables = [
        profile_table(f"**graph for {p.graph_context} positions**", p.summary, TABLE_KERNELS)
        for p in profiles
    ]
    return "\n\n".join([markdown_table(headers, rows), *tables])


def step_kernels_figures(profiles: Sequence[GraphStepProfile]) -> dict[str, object]:
    """For results.jsonl: per graph its totals and its kernels (name, launches and device us a step: the
    kernel's exclusive time where the summary has it, as in the table)."""
    graphs = []
    for p in profiles:
        steps = max(1, p.summary["steps"])
        kernels = [
            {"name": e["name"], "launches": e["count"] / steps, "us": kernel_us(e) / steps} for e in p.kernels
        ]
        graphs.append({"graph_context": p.graph_context, "step_s": p.step_s, "device_s": p.device_s,
                       "launches": p.launches, "kernels": kernels})  # fmt: skip
    return {"graphs": graphs}
