"""torch.profiler over a number of the engine core's forward steps, on the frontend's word (SMG's
StartProfile / StopProfile RPCs; `sluice serve --profile-dir`).

    StartProfile(output_dir, num_steps)   the profiler starts before the next step
    each forward launched                 counted, with its rows (tokens); the profile ends when the
                                          step that launched the num_steps-th takes in sampled tokens
    StopProfile                           ends it early (or does nothing when none runs)

An ended profile is written to output_dir as three files named `profile-<UTC time>-<pid>`:
    .json           the summary the GPU check reads: steps, rows per step, wall seconds, and the top
                    operators and kernels by their own device time (CPU time where nothing ran on a device),
                    with each kernel's exclusive time and the device's busy time (`device_times`)
    .txt            torch's key_averages table, sorted the same way
    .trace.json.gz  the Chrome / Perfetto trace
With async scheduling the device may still be running the last counted step when the count is reached: the
profiler is stopped after the device has finished (a synchronize), so every counted step's kernels are in.
Kernels replayed from CUDA graphs show up one by one where CUPTI reports them (CUDA 12+).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from sluice.engine.messages import StartProfile

logger = logging.getLogger("sluice.engine_core")

SUMMARY_TOP = 100  # operators and kernels kept in the summary
TABLE_ROWS = 80  # rows of the key_averages table
ACTIVITIES = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}


@dataclass
class _Run:
    output_dir: Path
    num_steps: int
    profiler: torch.profiler.profile
    started: float
    rows: list[int] = field(default_factory=list)


class StepProfiler:
    """At most one profile at a time: the engine core calls `forward_launched` for each forward and
    `step_ended` when a step's sampled tokens are taken in (`EngineCore._update`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._run: _Run | None = None

    def start(self, request: StartProfile) -> None:
        """Starts a profile of the next `request.num_steps` forwards (0: until `stop`); a running one is
        ended and written first. Activities "CPU" and/or "GPU" (none: both where a GPU is used, else CPU)."""
        if self._run is not None:
            self.stop()
        wanted = request.activities or (["CPU", "GPU"] if self.device.type == "cuda" else ["CPU"])
        profiler = torch.profiler.profile(
            activities=[ACTIVITIES[name] for name in wanted],
            record_shapes=request.record_shapes,
            with_stack=request.with_stack,
        )
        try:
            profiler.start()
        except Exception:  # e.g. CUPTI missing: profiling never takes the engine down
            logger.exception("the profiler could not start")
            return
        self._run = _Run(Path(request.output_dir), request.num_steps, profiler, time.perf_counter())
        steps = f"the next {request.num_steps}" if request.num_steps else "the"
        logger.info("profiling %s forward steps into %s", steps, request.output_dir)

    def forward_launched(self, num_tokens: int) -> None:
        """A forward of `num_tokens` rows was launched in this step."""
        if self._run is not None:
            self._run.rows.append(num_tokens)

    def step_ended(self) -> None:
        """A step's sampled tokens were taken in: the profile ends once it has num_steps forwards."""
        run = self._run
        if run is not None and run.num_steps and len(run.rows) >= run.num_steps:
            self.stop()

    def stop(self) -> Path | None:
        """Ends the running profile and writes it; the summary's path, or None when none ran."""
        run, self._run = self._run, None
        if run is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last steps' kernels, still in flight, belong to it
        wall_s = time.perf_counter() - run.started
        try:
            run.profiler.stop()
            return self._write(run, wall_s)
        except Exception:  # a full disk, a directory gone, the profiler's own error: never the engine's
            logger.exception("the profile could not be written to %s", run.output_dir)
            return None

    @staticmethod
    def _write(run: _Run, wall_s: float) -> Path:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        stem = _new_stem(run.output_dir)
        averages = run.profiler.key_averages()
        on_device = any(device_us(event) > 0 for event in averages)
        sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
        stem.with_suffix(".txt").write_text(averages.table(sort_by=sort_by, row_limit=TABLE_ROWS) + "\n")
        run.profiler.export_chrome_trace(str(stem.with_suffix(".trace.json.gz")))
        summary = summarize(averages, run.rows, wall_s, on_device, run.profiler.events())
        path = stem.with_suffix(".json")
        path.write_text(json.dumps(summary, indent=1) + "\n")
        logger.info("profile of %d forward steps written: %s", len(run.rows), path)
        return path


def _new_stem(output_dir: Path) -> Path:
    """profile-<UTC time to the millisecond: 20261204T075352123Z>-<pid>, with -2, -3, ... after it if a
    profile of the same millisecond is there already (a profile never overwrites another)."""
    now = time.time()
    seconds = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    # No "." in the name: the files are named by replacing its suffix.
    base = output_dir / f"profile-{seconds}{int(now * 1000) % 1000:03d}Z-{os.getpid()}"
    stem, number = base, 1
    while stem.with_suffix(".json").exists():
        number += 1
        stem = base.with_name(f"{base.name}-{number}")
    return stem


def device_us(event: Any) -> float:
    """An event's own device time, microseconds (0 for one that ran on no device)."""
    return float(getattr(event, "self_device_time_total", 0.0) or 0.0)


def summarize(
    averages: Any, rows: list[int], wall_s: float, on_device: bool, events: Iterable[Any] = ()
) -> dict[str, Any]:
    """The summary of a profile: per entry of `averages` (torch's FunctionEventAvg list) its name, calls,
    own device time and own CPU time (microseconds), the SUMMARY_TOP largest by the time that was measured;
    device totals count kernels (device-side events) only, so nothing is counted twice. Where `events`
    (the profiler's own, `profiler.events()`) hold kernels, each kernel's entry also has its exclusive time
    and the summary the device's busy time and the overlap between kernels (`device_times`)."""
    entries = [
        {
            "name": event.key,
            "count": int(event.count),
            "self_device_us": round(device_us(event), 1),
            "self_cpu_us": round(float(event.self_cpu_time_total), 1),
            "on_device": _on_device(event),
        }
        for event in averages
    ]
    key = "self_device_us" if on_device else "self_cpu_us"
    entries.sort(key=lambda entry: entry[key], reverse=True)
    kernels = [entry for entry in entries if entry["on_device"]]
    summary = {
        "steps": len(rows),
        "rows_per_step": rows,
        "wall_s": round(wall_s, 4),
        "measured": "device" if on_device else "cpu",
        "device_us_total": round(sum(entry["self_device_us"] for entry in kernels), 1),
        "cpu_us_total": round(sum(entry["self_cpu_us"] for entry in entries), 1),
        "top": entries[:SUMMARY_TOP],
    }
    times = device_times(events)
    if times is not None:
        for entry in kernels:
            entry["exclusive_device_us"] = round(times.exclusive_us.get(entry["name"], 0.0), 1)
        summary["device_busy_us_total"] = round(times.busy_us, 1)
        summary["device_overlap_us"] = round(times.overlap_us, 1)
    return summary


def _on_device(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith(("CUDA", "PrivateUse1"))


KernelInterval = tuple[str, float, float]  # (name, start us, end us)


class DeviceTimes(NamedTuple):
    exclusive_us: dict[str, float]  # per kernel name, summed over its launches and the devices
    busy_us: float  # the union of each device's kernel intervals, summed over the devices
    overlap_us: float  # the kernels' durations summed, less busy_us


def device_times(events: Iterable[Any]) -> DeviceTimes | None:
    """The exclusive times of the device-side events among the profiler's `events` (kernels, copies,
    fills), and the busy time of their devices; None where none ran on a device. GPU user annotations are
    left out: they are ranges around other kernels, not work of their own."""
    per_device: dict[tuple[str, int], list[KernelInterval]] = {}
    for event in events:
        if _on_device(event) and not getattr(event, "is_user_annotation", False):
            device = (str(event.device_type), int(getattr(event, "device_index", 0)))
            interval = (event.key, float(event.time_range.start), float(event.time_range.end))
            per_device.setdefault(device, []).append(interval)
    if not per_device:
        return None
    exclusive: dict[str, float] = {}
    for intervals in per_device.values():
        for name, us in exclusive_us(intervals).items():
            exclusive[name] = exclusive.get(name, 0.0) + us
    duration_us = sum(end - start for intervals in per_device.values() for _, start, end in intervals)
    busy_us = sum(exclusive.values())
    return DeviceTimes(exclusive, busy_us, duration_us - busy_us)


def exclusive_us(intervals: Iterable[KernelInterval]) -> dict[str, float]:
    """Per kernel name, the exclusive time of one device's kernel `intervals`: the part of each interval
    that no kernel starting before it covered.

    With programmatic dependent launch a kernel is launched while the one before it still runs, and waits
    inside for it to end: its recorded interval holds that wait, and the kernels' durations sum to more
    than the device was busy. Counted from where the kernels before it ended, each moment is counted once:

        A  |=========|                 A: all of its own interval
        B       |.....=======|         B: from A's end to its own
        C          |==|                C: 0 (inside B's interval)
        D                       |===|  D: all of it (the gap before it is nobody's)

    So the exclusive times sum to the union of the intervals: the time the device was busy."""
    exclusive: dict[str, float] = {}
    covered_until = -math.inf  # the latest end of the kernels so far
    for name, start, end in sorted(intervals, key=lambda interval: interval[1]):
        exclusive[name] = exclusive.get(name, 0.0) + max(0.0, end - max(start, covered_until))
        covered_until = max(covered_until, end)
    return exclusive
