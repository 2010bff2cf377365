"""The GPU check's figures set against their limits and issue 33's goals, from what its steps recorded.

Pure functions over the records of OUT/results.jsonl (scripts/gpu_check.py's sections, the serve steps)
and the `sluice bench` JSON files; the limits are computed from ceilings measured in the same run:

- a batch-1 decode step's floor: weight bytes / measured copy bandwidth (scripts/gpu_check.py);
- the 8b shape's batch-1 TPOT floor: its bf16 weight bytes / the same bandwidth (KV reads left out,
  as in issue 33's table; at a 4k context they add ~3%);
- a prompt's TTFT floor: its FLOPs / the measured bf16 matrix product rate, where the FLOPs are
  2 x (parameters outside the embedding and the head) per prompt token, the causal attention of every
  layer, and the head once (only the last token's logits are computed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sluice.benchmarks.gpu.gpu_benchmarks import (
    BATCH1_STEP_OVER_FLOOR_GOAL,
    DECODE_ATTENTION_GOALS,
    PREFILL_VS_SDPA_GOAL,
    causal_attention_flops,
)
from sluice.engine.config import DEFAULT_STEP_BUDGET

TPOT_OVER_GRAPH_STEP_GOAL = 1.2  # 1b TPOT over gRPC at 64 concurrent vs the graph step at batch 64
LARGE_FLOOR_OVER_TPOT_GOAL = 0.8  # 8b batch-1 TPOT over gRPC: at least 80% of the floor's speed
TTFT_OVER_FLOOR_GOAL = 1.3  # 8b TTFT of a 4096-token prompt vs its FLOP floor
HEADERS = ["what", "Sluice", "limit / peer", "ratio", "goal", "status"]


def model_numbers(preset: str) -> dict[str, float]:
    """Parameter counts of a preset read off its model class (nothing allocated); bf16 weight bytes."""
    from sluice.engine.loading.model_loader import checkpoint_weight_shapes
    from sluice.engine.loading.presets import preset_arch

    arch = preset_arch(preset)
    sizes = {name: math.prod(shape) for name, shape in checkpoint_weight_shapes(arch)}
    params = sum(sizes.values())
    outside = sum(size for name, size in sizes.items() if "embed_tokens" in name or "lm_head" in name)
    return {
        "weight_bytes": 2.0 * params,
        "body_params": float(params - outside),
        "head_params": float(arch.vocab_size * arch.hidden_size),
        "layers": arch.num_hidden_layers,
        "heads": arch.num_attention_heads,
        "head_dim": arch.head_dim,
    }


def prompt_flops(numbers: dict[str, float], prompt_len: int) -> float:
    attention = numbers["layers"] * causal_attention_flops(prompt_len, numbers["heads"], numbers["head_dim"])
    return 2 * numbers["body_params"] * prompt_len + attention + 2 * numbers["head_params"]


def gpu_check_figures(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """scripts/gpu_check.py's figures by section (the last record of each)."""
    return {r["section"]: r["figures"] for r in records if r.get("step") == "gpu_check" and "section" in r}


def run_metric(runs: list[dict[str, Any]], concurrency: int | None, path: tuple[str, ...]) -> float | None:
    """A metric of the bench run at `concurrency` (None: the first run), e.g. ("tpot", "p50")."""
    for run in runs:
        if concurrency is None or run["config"].get("concurrency") == concurrency:
            value: Any = run["metrics"]
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            return value
    return None


def _status(value: float, goal: float, at_most: bool) -> str:
    return "met" if (value <= goal if at_most else value >= goal) else "NOT met"


def _row(what: str, ours: str, limit: str, ratio: float, goal: str = "", status: str = "") -> list[object]:
    return [what, ours, limit, f"{ratio:.2f}", goal, status]


def kernel_rows(figures: dict[str, dict[str, Any]]) -> list[list[object]]:
    """Prefill and decode attention, and the 1b batch-1 graph step, against their limits."""
    rows: list[list[object]] = []
    for r in figures.get("prefill", {}).get("rows", []):
        speed = r["ours_over_sdpa_speed"]
        rows.append(
            _row(
                f"prefill attention, {r['prompt'] // 1024}k causal, TFLOP/s",
                f"{r['ours_tflops']:.1f}",
                f"torch SDPA {r['sdpa_tflops']:.1f}",
                speed,
                f">= {PREFILL_VS_SDPA_GOAL}",
                _status(speed, PREFILL_VS_SDPA_GOAL, at_most=False),
            )
        )
    copy = figures.get("ceilings", {}).get("copy_bytes_per_s")
    for r in figures.get("attention", {}).get("rows", []):
        goal = DECODE_ATTENTION_GOALS.get((r["context"], r["batch"]))
        rows.append(
            _row(
                f"paged decode attention, {r['context'] // 1024}k x {r['batch']}, GB/s",
                f"{r['gb_per_s']:.0f}",
                f"copy {copy / 1e9:.0f}" if copy else "",
                r["of_copy_bw"],
                "" if goal is None else f">= {goal:.2f}",
                "" if goal is None else _status(r["of_copy_bw"], goal, at_most=False),
            )
        )
    decode = figures.get("decode")
    if decode:
        step = decode["graph_step_s"]["1"]
        ratio = step / decode["floor_s"]
        rows.append(
            _row(
                "1b batch-1 decode step (CUDA graph), ms",
                f"{step * 1e3:.2f}",
                f"floor {decode['floor_s'] * 1e3:.2f}",
                ratio,
                f"<= {BATCH1_STEP_OVER_FLOOR_GOAL}",
                _status(ratio, BATCH1_STEP_OVER_FLOOR_GOAL, at_most=True),
            )
        )
    return rows


def serving_rows(figures: dict[str, dict[str, Any]], serve_runs: list[dict[str, Any]]) -> list[list[object]]:
    """1b TPOT over gRPC (p50) at concurrency 1 and 64 against the graph step at that batch."""
    graph = figures.get("decode", {}).get("graph_step_s", {})
    rows: list[list[object]] = []
    for concurrency in (1, 64):
        tpot = run_metric(serve_runs, concurrency, ("tpot", "p50"))
        step = graph.get(str(concurrency))
        if tpot is None or step is None:
            continue
        ratio = tpot / step
        goal = concurrency == 64
        rows.append(
            _row(
                f"1b TPOT p50 over gRPC, concurrency {concurrency}, ms",
                f"{tpot * 1e3:.2f}",
                f"graph step at batch {concurrency}: {step * 1e3:.2f}",
                ratio,
                f"<= {TPOT_OVER_GRAPH_STEP_GOAL}" if goal else "",
                _status(ratio, TPOT_OVER_GRAPH_STEP_GOAL, at_most=True) if goal else "",
            )
        )
    return rows


def large_rows(
    figures: dict[str, dict[str, Any]],
    large_runs: list[dict[str, Any]],
    numbers: dict[str, float],
    baseline_runs: Sequence[dict[str, Any]] = (),
    default_budget: int | None = None,
) -> list[list[object]]:
    """8b shape: batch-1 TPOT against the weight-bytes floor, TTFT against the FLOP floor; with
    `baseline_runs` (the same bench on a server with the 2048-token step budget), its TTFT against the
    default budget's (`default_budget` tokens, as the default server reported it, where known)."""
    ceilings = figures.get("ceilings", {})
    rows: list[list[object]] = []
    tpot = run_metric(large_runs, None, ("tpot", "p50"))
    copy = ceilings.get("copy_bytes_per_s")
    if tpot is not None and copy:
        floor = numbers["weight_bytes"] / copy
        share = floor / tpot
        rows.append(
            _row(
                "8b batch-1 TPOT p50 over gRPC, ms",
                f"{tpot * 1e3:.2f}",
                f"floor {floor * 1e3:.2f}",
                share,
                f"floor/TPOT >= {LARGE_FLOOR_OVER_TPOT_GOAL}",
                _status(share, LARGE_FLOOR_OVER_TPOT_GOAL, at_most=False),
            )
        )
    ttft = run_metric(large_runs, None, ("ttft", "p50"))
    matmul = ceilings.get("bf16_matmul_flops_per_s")
    if ttft is not None and matmul and large_runs:
        prompt_len = large_runs[0]["config"]["workload"]["input_len"]
        floor = prompt_flops(numbers, prompt_len) / matmul
        ratio = ttft / floor
        rows.append(
            _row(
                f"8b TTFT p50, {prompt_len}-token prompt, ms",
                f"{ttft * 1e3:.1f}",
                f"FLOP floor {floor * 1e3:.1f}",
                ratio,
                f"<= {TTFT_OVER_FLOOR_GOAL}",
                _status(ratio, TTFT_OVER_FLOOR_GOAL, at_most=True),
            )
        )
        baseline = run_metric(list(baseline_runs), None, ("ttft", "p50"))
        if baseline is not None:
            rows.append(
                _row(
                    f"8b TTFT p50, {prompt_len}-token prompt, step budget {DEFAULT_STEP_BUDGET}, ms",
                    f"{baseline * 1e3:.1f}",
                    f"the default budget's ({default_budget or '?'}) {ttft * 1e3:.1f}",
                    baseline / ttft,
                )
            )
    return rows
