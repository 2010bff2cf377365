"""Issue 34's figures from the GPU check's fp8 and fp8_large steps: bf16 vs fp8 weights vs fp8 weights + fp8
KV cache.

Pure functions over what the steps recorded: serve_bench's record (the bf16 server's KV blocks and greedy
reference) and its `sluice bench` runs (bench_serve.json), and the fp8 step's record of each server
(`variant_servers.variant_server`: its model info, greedy agreement, `sluice bench` runs at concurrency 1
and 64, and the lines of its log that name its KV cache and attention backend). All three servers run the same
preset, one after another on the same device, at the same prompt and output lengths. The fp8_large step's
servers (the llama-3-8b shape: those three, then fp8 weights in 128 x 128 blocks) are all its own records,
the bf16 one the reference.

The issue's targets: on an H100/H200, fp8 weights' batch-1 TPOT <= 0.6x bf16's on the llama-3-8b shape,
output throughput at 64 concurrent >= 1.3x bf16's, and twice the KV blocks with an fp8 cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.benchmarks.gpu.check_figures import model_numbers, run_metric

TPOT_RATIO_GOAL = 0.6  # fp8 weights' batch-1 TPOT / bf16's, set on the llama-3-8b shape
THROUGHPUT_RATIO_GOAL = 1.3  # output tokens/s at 64 concurrent / bf16's
KV_BLOCKS_RATIO_GOAL = 2.0  # KV blocks with an fp8 cache / bf16's
GOAL_SHAPE = "llama-3-8b"
VARIANTS = {"fp8": "fp8 weights", "fp8_kv": "fp8 weights + fp8 KV"}  # the fp8 step's servers, in order
# fp8_large's: those, the norms (then SiLU-and-mul too) in the FP8 linears' launches (a GPU only), then the
# block-wise path (`variant_servers.large_variants`)
LARGE_LABELS = {
    **VARIANTS,
    "fp8_norm": "fp8 weights, RMSNorms in the linears",
    "fp8_fold": "fp8 weights, RMSNorms and SiLU-and-mul in the linears",
    "fp8_block": "fp8 weights, 128 x 128 blocks",
}
# The selector's log line (INFO) when triton takes an fp8 cache, as `auto` on CUDA does: `FP8_KV_TRITON_NOTE`.
TRITON_FP8_KV = "the triton attention backend reads the e4m3 cache"


def table_headers(reference: str) -> list[str]:
    """The table's columns; the greedy outputs are set against `reference`'s."""
    return ["server", "TPOT p50 ms, c=1", "TPOT p50 ms, c=64", "out tok/s, c=64", "KV blocks",
            "requests done", f"greedy vs {reference}"]  # fmt: skip


TABLE_HEADERS = table_headers("serve_bench")
TARGET_HEADERS = ["target (issue 34)", "measured", "goal", "status"]


@dataclass(frozen=True)
class ServerFigures:
    """One server's figures; None where its run did not record them."""

    tpot_1: float | None  # TPOT p50 at concurrency 1, s
    tpot_64: float | None  # TPOT p50 at concurrency 64, s
    throughput_64: float | None  # output tokens/s at concurrency 64
    kv_blocks: int | None
    done: tuple[int, int]  # requests completed, requests sent, over its runs

    @classmethod
    def of(cls, runs: list[dict[str, Any]], model_info: dict[str, Any] | None) -> ServerFigures:
        """From `sluice bench` runs (only those at concurrency 1 and 64 count) and GetModelInfo's fields."""
        counted = [run["metrics"] for run in runs if run["config"].get("concurrency") in (1, 64)]
        return cls(
            run_metric(runs, 1, ("tpot", "p50")),
            run_metric(runs, 64, ("tpot", "p50")),
            run_metric(runs, 64, ("output_throughput",)),
            (model_info or {}).get("num_kv_blocks"),
            (sum(m["num_completed"] for m in counted), sum(m["num_requests"] for m in counted)),
        )


def variant_records(records: list[dict[str, Any]], step: str = "fp8") -> dict[str, dict[str, Any]]:
    """The record of each server `step` (fp8, async) finished, by variant name (the last of each)."""
    return {r["variant"]: r for r in records if r.get("step") == step and "variant" in r}


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def _cell(value: float | None, base: float | None, scale: float, digits: int) -> str:
    """`value` (times `scale`), and its ratio to `base` in brackets: "1.52 (0.72x)"; "-" if missing."""
    if value is None:
        return "-"
    ratio = _ratio(value, base)
    return f"{value * scale:.{digits}f}" + ("" if ratio is None else f" ({ratio:.2f}x)")


def _agreement(record: dict[str, Any]) -> str:
    a = record["agreement"]
    return (
        f"{a['equal']}/{a['samples']} equal; {a['tokens_before_first_difference']}/{a['tokens']} tokens "
        "before the first difference"
    )


def table_rows(
    bf16: ServerFigures,
    variants: dict[str, dict[str, Any]],
    base_name: str = "bf16",
    labels: dict[str, str] = VARIANTS,
    base_source: str = "serve_bench",
) -> list[list[object]]:
    """A row per server: the reference's (`base_name`: bf16 on a GPU, `base_source`'s server) first, then
    each of `labels`' variants (ratios to the first in brackets)."""

    def row(name: str, figures: ServerFigures, base: ServerFigures | None, greedy: str) -> list[object]:
        def cell(field: str, scale: float, digits: int) -> str:
            return _cell(getattr(figures, field), base and getattr(base, field), scale, digits)

        done = f"{figures.done[0]}/{figures.done[1]}"
        return [name, cell("tpot_1", 1e3, 2), cell("tpot_64", 1e3, 2), cell("throughput_64", 1.0, 0),
                cell("kv_blocks", 1.0, 0), done, greedy]  # fmt: skip

    rows = [row(f"{base_name} ({base_source})", bf16, None, "the reference")]
    for name, label in labels.items():
        record = variants.get(name)
        if record is None:
            rows.append([label, "-", "-", "-", "-", "-", "not run"])
            continue
        figures = ServerFigures.of(record["runs"], record["model_info"])
        rows.append(row(label, figures, bf16, _agreement(record)))
    return rows


def _target(what: str, ratio: float | None, goal: float, at_most: bool) -> list[object]:
    if ratio is None:
        return [what, "-", f"{'<=' if at_most else '>='} {goal}", "not measured"]
    met = ratio <= goal if at_most else ratio >= goal
    return [what, f"{ratio:.2f}", f"{'<=' if at_most else '>='} {goal}", "met" if met else "NOT met"]


def target_rows(
    bf16: ServerFigures, variants: dict[str, dict[str, Any]], preset: str, base_name: str = "bf16"
) -> list[list[object]]:
    """Issue 34's targets against this run's ratios to serve_bench's server (`base_name`: bf16 on a GPU);
    the batch-1 one names the shape it ran on."""
    figures = {
        name: ServerFigures.of(record["runs"], record["model_info"]) for name, record in variants.items()
    }
    fp8, fp8_kv = figures.get("fp8"), figures.get("fp8_kv")
    shape = "the goal's shape" if preset == GOAL_SHAPE else f"here {preset}, the goal is set on {GOAL_SHAPE}"
    rows = [
        _target(
            f"fp8 weights: batch-1 TPOT p50 / {base_name}'s ({shape})",
            _ratio(fp8 and fp8.tpot_1, bf16.tpot_1),
            TPOT_RATIO_GOAL,
            at_most=True,
        )
    ]
    for name, server in (("fp8", fp8), ("fp8_kv", fp8_kv)):
        rows.append(
            _target(
                f"{VARIANTS[name]}: out tok/s at 64 concurrent / {base_name}'s",
                _ratio(server and server.throughput_64, bf16.throughput_64),
                THROUGHPUT_RATIO_GOAL,
                at_most=False,
            )
        )
    rows.append(
        _target(
            f"fp8 KV: KV blocks / {base_name}'s",
            _ratio(fp8_kv and fp8_kv.kv_blocks, bf16.kv_blocks),
            KV_BLOCKS_RATIO_GOAL,
            at_most=False,
        )
    )
    alone = _ratio(fp8_kv and fp8_kv.kv_blocks, fp8 and fp8.kv_blocks)
    if alone is not None:  # the same weights: the cache's dtype and what each server's profiling left
        rows.append(["fp8 KV: KV blocks / fp8 weights' (same weights)", f"{alone:.2f}", "", ""])
    return rows


def step_bytes_ratio(preset: str) -> float:
    """Weight bytes a batch-1 decode step reads with fp8 weights over bf16's: every linear but lm_head
    (which stays bf16) at 1 byte a weight instead of 2; the floor of the batch-1 TPOT ratio."""
    numbers = model_numbers(preset)
    body, head = numbers["body_params"], numbers["head_params"]
    return (body + 2 * head) / (2 * body + 2 * head)


def backend_note(variants: dict[str, dict[str, Any]], mode: str) -> str:
    """What the fp8-KV server's speed measures: on CUDA, the Triton attention backend with CUDA graphs."""
    if mode == "cpu":
        return (
            "CPU mode: FP8 is emulated (a correctness path, not a speed path) and the cache is float32, so "
            "an fp8 cache holds 4x its blocks; these speeds say nothing about a GPU."
        )
    notes = (variants.get("fp8_kv") or {}).get("server_notes", [])
    seen = any(TRITON_FP8_KV in line for line in notes)
    return (
        "**The fp8-KV server's speed is the Triton attention backend's, with CUDA graphs, as bf16's:** on "
        "CUDA `auto` gives an FP8 cache to the Triton kernels, which store e4m3 codes and dequantize each "
        "K/V tile in registers (the selector's line saying so: "
        + ("seen in its log" if seen else "not found in its log")
        + "). So its TPOT and throughput are FP8 KV's as served, beside the same weights' fp8 server: the "
        "difference between the two is the cache's dtype."
    )


def shape_line(preset: str, elsewhere: str) -> str:
    """Which shape the run is on (`elsewhere`: where the goal's shape runs, if not here), and the floor of
    the batch-1 TPOT ratio on the 1b and 8b shapes."""
    goal = GOAL_SHAPE
    ratios = ", ".join(f"{step_bytes_ratio(p):.2f} on {p}" for p in ("llama-3.2-1b", goal))
    shape = (
        "." if preset == goal else f", not the {goal} one issue 34's batch-1 target is set on ({elsewhere})."
    )
    return (
        f"**Shape:** this run is on the {preset} shape{shape} The weight bytes a batch-1 step reads, fp8 "
        f"over bf16 (lm_head stays bf16), the floor of that TPOT ratio: {ratios}."
    )
