"""Benchmark reports: the JSON document, the terminal tables, and `compare` of two documents.

The JSON document is {"runs": [run, ...]}: one run, or one per point of a sweep. A run holds its
"label", "config" (workload, load, SLO, target), "metrics" (RunMetrics.to_dict(), seconds and per
second) and "requests" (each request's timeline, for charts).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from sluice.bench.metrics import RequestRecord, RunMetrics

# (label, path into metrics, scale, unit) of the rows `compare` prints.
COMPARED = (
    ("request throughput", ("request_throughput",), 1.0, "req/s"),
    ("output throughput", ("output_throughput",), 1.0, "tok/s"),
    ("goodput", ("goodput",), 1.0, "req/s"),
    ("TTFT mean", ("ttft", "mean"), 1e3, "ms"),
    ("TTFT p50", ("ttft", "p50"), 1e3, "ms"),
    ("TTFT p99", ("ttft", "p99"), 1e3, "ms"),
    ("TPOT mean", ("tpot", "mean"), 1e3, "ms"),
    ("TPOT p99", ("tpot", "p99"), 1e3, "ms"),
    ("ITL p50", ("itl", "p50"), 1e3, "ms"),
    ("ITL p99", ("itl", "p99"), 1e3, "ms"),
    ("E2E p50", ("e2e", "p50"), 1e3, "ms"),
    ("E2E p99", ("e2e", "p99"), 1e3, "ms"),
)


def _finite(value: Any) -> Any:
    """JSON has no Infinity: infinite floats are written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def run_document(label: str, config: dict[str, Any], metrics: RunMetrics, records: Sequence[RequestRecord]):
    return {
        "label": label,
        "config": {key: _finite(value) for key, value in config.items()},
        "metrics": metrics.to_dict(),
        "requests": [
            {
                "index": r.index,
                "prompt_len": r.prompt_len,
                "output_tokens": r.num_output_tokens,
                "start": r.start,
                "ttft": r.ttft if r.ok else None,
                "tpot": r.tpot if r.ok else None,
                "e2e": r.e2e if r.ok else None,
                "itls": r.itls if r.ok else [],
                "error": r.error if not r.ok else None,
            }
            for r in records
        ],
    }


def write_json(path: str, runs: Sequence[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"runs": list(runs)}, f, indent=1)


def read_json(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        document = json.load(f)
    if not isinstance(document, dict) or not isinstance(document.get("runs"), list):
        raise ValueError(f"{path}: not a sluice bench JSON file (no 'runs' list)")
    return document["runs"]


def metric_value(metrics: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = metrics
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _cell(value: float | None, scale: float, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value * scale:>{width}.2f}"


# (header, path into metrics, scale) of the summary table's columns; latencies in ms.
TABLE_COLUMNS = (
    ("req/s", ("request_throughput",), 1.0),
    ("out tok/s", ("output_throughput",), 1.0),
    ("goodput/s", ("goodput",), 1.0),
    ("TTFT p50", ("ttft", "p50"), 1e3),
    ("TTFT p99", ("ttft", "p99"), 1e3),
    ("TPOT p50", ("tpot", "p50"), 1e3),
    ("TPOT p99", ("tpot", "p99"), 1e3),
    ("ITL p50", ("itl", "p50"), 1e3),
    ("ITL p99", ("itl", "p99"), 1e3),
    ("E2E p50", ("e2e", "p50"), 1e3),
    ("E2E p99", ("e2e", "p99"), 1e3),
)


def format_runs(runs: Sequence[dict[str, Any]]) -> str:
    """One row per run: throughputs, goodput, latency percentiles (ms), errors by status code."""
    header = f"{'run':<24}{'done':>9}" + "".join(f"{name:>11}" for name, *_ in TABLE_COLUMNS) + "  errors"
    lines = [header]
    for run in runs:
        m = run["metrics"]
        cells = "".join(_cell(metric_value(m, path), scale, 11) for _, path, scale in TABLE_COLUMNS)
        errors = ", ".join(f"{code}={n}" for code, n in m["errors"].items()) or "none"
        done = f"{m['num_completed']}/{m['num_requests']}"
        lines.append(f"{run['label'][:23]:<24}{done:>9}{cells}  {errors}")
    return "\n".join(lines)


def compare(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> str:
    """Each metric of A's and B's runs (paired in order) side by side with the ratio B / A."""
    if len(a) != len(b):
        raise ValueError(f"compare: A has {len(a)} runs and B has {len(b)}; they must pair up")
    blocks = []
    for run_a, run_b in zip(a, b, strict=True):
        lines = [f"{'metric':<28}{'A: ' + run_a['label']:>24}{'B: ' + run_b['label']:>24}{'B/A':>9}"]
        for name, path, scale, unit in COMPARED:
            value_a = metric_value(run_a["metrics"], path)
            value_b = metric_value(run_b["metrics"], path)
            ratio = "-" if not value_a or value_b is None else f"{value_b / value_a:.2f}x"
            label = f"{name} ({unit})"
            lines.append(f"{label:<28}{_cell(value_a, scale, 24)}{_cell(value_b, scale, 24)}{ratio:>9}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
