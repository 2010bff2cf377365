"""Benchmark reports: the JSON document, the terminal tables, and `compare` of two documents.

The JSON document is {"runs": [run, ...]}: one run, or one per point of a sweep. A run holds its
"label", "config" (workload, load, SLO, target), "metrics" (RunMetrics.to_dict(), seconds and per
second; the prompt tokens the server served from its prefix cache and those it computed),
"requests" (each request's timeline, for charts), "shared_prefix_len" (prompt tokens its workload
shares by design) and "cache_hits_unexpected": true when a request was served more than that from the
prefix cache, so that the run measured the cache; the table then marks it and prints a warning.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from sluice.bench.metrics import RequestRecord, RunMetrics, unexpected_cache_hits

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


def run_document(
    label: str,
    config: dict[str, Any],
    metrics: RunMetrics,
    records: Sequence[RequestRecord],
    *,
    shared_prefix_len: int = 0,
) -> dict[str, Any]:
    """`shared_prefix_len`: prompt tokens the run's workload shares by design (Workload.shared_prefix_len)."""
    num_unexpected = unexpected_cache_hits(records, shared_prefix_len)
    return {
        "label": label,
        "config": {key: _finite(value) for key, value in config.items()},
        "metrics": metrics.to_dict(),
        "shared_prefix_len": shared_prefix_len,
        "cache_hits_unexpected": num_unexpected > 0,
        "num_unexpected_cache_hits": num_unexpected,
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
                "cached_tokens": r.cached_tokens,
                "prompt_tokens_computed": r.prompt_tokens_computed,
            }
            for r in records
        ],
    }


def write_json(path: str, runs: Sequence[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"runs": list(runs)}, f, indent=1)


def read_json(path: str) -> list[dict[str, Any]]:
    """The runs of the sluice bench JSON file at `path`; a ValueError naming `path` if it is not one."""
    try:
        with open(path) as f:
            document = json.load(f)
    except ValueError as exc:  # not JSON (json.JSONDecodeError) or not text (UnicodeDecodeError)
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(document, dict) or not isinstance(document.get("runs"), list):
        raise ValueError(f"{path}: not a sluice bench JSON file (no 'runs' list)")
    for index, run in enumerate(document["runs"]):
        if not _is_run(run):
            raise ValueError(f"{path}: run {index} has no 'label' or no numeric 'metrics'")
    return document["runs"]


def _is_run(run: Any) -> bool:
    """Whether `run` holds what `compare` reads: a label, and metrics whose compared values are numbers
    or null."""
    if not isinstance(run, dict) or not isinstance(run.get("label"), str):
        return False
    if not isinstance(run.get("metrics"), dict):
        return False
    values = (metric_value(run["metrics"], path) for _, path, _, _ in COMPARED)
    return all(v is None or type(v) in (int, float) for v in values)


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
    """One row per run: prompt tokens (all, served from the prefix cache, computed), throughputs,
    goodput, latency percentiles (ms), errors by status code. A run whose requests hit the prefix cache
    beyond what its workload shares is marked "!" and explained under the table."""
    header = f"{'run':<24}{'done':>9}{'prompt':>9}{'cached':>10}{'computed':>10}"
    header += "".join(f"{name:>11}" for name, *_ in TABLE_COLUMNS) + "  errors"
    lines, warnings = [header], []
    for run in runs:
        m = run["metrics"]
        cells = "".join(_cell(metric_value(m, path), scale, 11) for _, path, scale in TABLE_COLUMNS)
        errors = ", ".join(f"{code}={n}" for code, n in m["errors"].items()) or "none"
        done = f"{m['num_completed']}/{m['num_requests']}"
        flag = "!" if run.get("cache_hits_unexpected") else " "
        cached = f"{_count(m.get('cached_prompt_tokens'))}{flag}"
        tokens = f"{m['prompt_tokens']:>9}{cached:>10}{_count(m.get('computed_prompt_tokens')):>10}"
        lines.append(f"{run['label'][:23]:<24}{done:>9}{tokens}{cells}  {errors}")
        if run.get("cache_hits_unexpected"):
            warnings.append(cache_warning(run))
    return "\n".join(lines + warnings)


def cache_warning(run: dict[str, Any]) -> str:
    """The line that explains a run flagged `cache_hits_unexpected`."""
    shared, m = run.get("shared_prefix_len", 0), run["metrics"]
    shares = f"shares only its {shared}-token prefix" if shared else "shares no prefix"
    return (
        f"warning: {run['label']}: {run['num_unexpected_cache_hits']} requests hit the prefix cache "
        f"({m['cached_prompt_tokens']} of {m['prompt_tokens']} prompt tokens cached) "
        f"although the workload {shares}: its TTFT and throughput measure the cache, not the engine "
        "(the server has seen these prompts: restart it or pass another --seed)"
    )


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def compare(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> str:
    """Each metric of A's and B's runs (paired in order) side by side with the ratio B / A."""
    if len(a) != len(b):
        raise ValueError(f"A has {len(a)} runs and B has {len(b)}; they must pair up")
    blocks = []
    for run_a, run_b in zip(a, b, strict=True):
        lines = [f"{'metric':<28}{'A: ' + run_a['label']:>24}{'B: ' + run_b['label']:>24}{'B/A':>9}"]
        for name, path, scale, unit in COMPARED:
            value_a = metric_value(run_a["metrics"], path)
            value_b = metric_value(run_b["metrics"], path)
            ratio = "-" if not value_a or value_b is None else f"{value_b / value_a:.2f}x"
            label = f"{name} ({unit})"
            lines.append(f"{label:<28}{_cell(value_a, scale, 24)}{_cell(value_b, scale, 24)}{ratio:>9}")
        lines += [f"{side}: {cache_warning(run)}" for side, run in (("A", run_a), ("B", run_b))
                  if run.get("cache_hits_unexpected")]  # fmt: skip
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
