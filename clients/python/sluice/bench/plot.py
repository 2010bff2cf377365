"""PNG charts of benchmark documents (see report.py), drawn with matplotlib's Agg backend.

latency_cdfs  one panel per latency (TTFT, TPOT, ITL, E2E): the empirical CDF of every run
sweep         output throughput and p99 latencies against the swept concurrency
bars          one value per named configuration (make bench's throughputs and ratios)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

_LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "inter-token latency"), ("e2e", "end-to-end"))


def _samples(run: dict[str, Any], key: str) -> list[float]:
    requests = [r for r in run["requests"] if r["error"] is None]
    if key == "itl":
        return sorted(gap for r in requests for gap in r["itls"])
    return sorted(r[key] for r in requests if r[key] is not None)


def latency_cdfs(runs: Sequence[dict[str, Any]], path: str) -> str:
    """Writes the four latency CDFs of `runs` to `path` (PNG); returns the path."""
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title) in zip(axes.flat, _LATENCIES, strict=True):
        for run in runs:
            values = _samples(run, key)
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.step([v * 1e3 for v in values], fractions, where="post", label=run["label"])
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    return _save(figure, path)


def sweep(runs: Sequence[dict[str, Any]], path: str, x_key: str = "concurrency") -> str:
    """Throughput and p99 latencies against `config[x_key]` of each run; writes `path` (PNG)."""
    xs = [run["config"][x_key] for run in runs]
    metrics = [run["metrics"] for run in runs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(xs, [m["output_throughput"] for m in metrics], marker="o")
    left.set_title("output throughput")
    left.set_ylabel("tokens / s")
    for key, title in _LATENCIES:
        right.plot(xs, [_ms(m[key]["p99"]) for m in metrics], marker="o", label=f"{title} p99")
    right.set_title("p99 latency")
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xlabel(x_key)
        ax.grid(alpha=0.3)
    return _save(figure, path)


def bars(names: Sequence[str], values: Sequence[float], path: str, *, title: str, ylabel: str) -> str:
    """A horizontal bar per configuration, value written at its end; writes `path` (PNG)."""
    figure, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.5))
    positions = range(len(names))
    ax.barh(positions, values)
    ax.set_yticks(list(positions), labels=list(names))
    ax.invert_yaxis()
    for y, value in zip(positions, values, strict=True):
        ax.text(value, y, f" {value:.3g}", va="center", fontsize=9)
    ax.set_title(title)
    ax.set_xlabel(ylabel)
    ax.grid(axis="x", alpha=0.3)
    return _save(figure, path)


def _ms(value: float | None) -> float:
    return float("nan") if value is None else value * 1e3


def _save(figure: Any, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
