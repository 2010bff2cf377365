"""OUT/report.md of `scripts/gpu_check.sh`: every step's status, the figures issues 33-35 ask for set
against their limits (issue 34's FP8 table too), and what each server step saw; built from
OUT/results.jsonl and the bench JSON. This module is the report's frame and its sections on the steps
around serve_bench's server; the sections on the variant servers (fp8, fp8_large, async) are in
`sluice.benchmarks.gpu.variant_sections`.

    python -m sluice.benchmarks.gpu.check_report OUT --mode gpu --wall-s 431 --budget-s 470

Exits 0 when every step passed or was skipped, 1 otherwise (the script's exit status).

The report's head says where the steps ran: the device, its card, the versions, the call's time and budget.
The first build of a report (the script's, on the machine that ran the steps) appends them to
results.jsonl as a `{"step": "report", ...}` record (not a GPU mode build on a machine without a GPU), so
a report rebuilt elsewhere (another machine's `check_report`, or `merge_calls` joining a lease's calls)
keeps that machine's head, not its own.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sluice.benchmarks.gpu import check_figures
from sluice.benchmarks.gpu.greedy_compare import comparison_line
from sluice.benchmarks.gpu.markdown_table import markdown_table
from sluice.benchmarks.gpu.step_context import PLANS, RESULTS, Plan, append_result, read_results, read_runs
from sluice.benchmarks.gpu.step_profiles import profile_table
from sluice.benchmarks.gpu.variant_sections import async_section, fp8_large_section, fp8_section

# The steps of scripts/gpu_check.sh, in order, and what each runs.
STEPS = {
    "install": "wheels from .whl/ and Sluice itself, pip --no-index --target",
    "kernel_tests": "kernel tests, compiled for the device (scripts/gpu_check.py --print-kernel-tests)",
    "gpu_check": "scripts/gpu_check.py: parity, ceilings, decode, attention, prefill, end to end",
    "serve_bench": "sluice serve + greedy reference + sluice bench --sweep 1,16,64",
    "speculative": "sluice serve --speculative ngram: greedy outputs equal serve_bench's",
    "structured": "JSON-schema requests, SmolLM2's tokenizer borrowed",
    "tensor_parallel": "sluice serve --tensor-parallel-size 2 (issue 35)",
    "fp8": "--quantization fp8, then + --kv-cache-dtype fp8: sluice bench at 1 and 64, greedy, KV blocks",
    "async": "--async-scheduling (then + --skinny-linears: SLUICE_GPU_CHECK_OFF_OPTIONS=1; + --speculative "
    "ngram, then paused at 16: SLUICE_GPU_CHECK_SPEC_ASYNC=1): greedy equal to serve_bench's, sluice bench "
    "at 1 and 64",
    "large": "llama-3-8b shape: batch-1 TPOT, 4096-token TTFT",
    "fp8_large": "llama-3-8b shape in bf16, fp8, fp8 + fp8 KV, fp8 128-blocks (fp8 with norms folded: "
    "SLUICE_GPU_CHECK_OFF_OPTIONS=1): sluice bench at 1 and 64, greedy, KV blocks",
    "kernel_bench": "kernels one at a time: FP8 linears at decode batch sizes vs bf16 (kernel_bench.md)",
}
FAILING = ("failed", "timed out", "out of time")


def step_records(records: list[dict[str, Any]]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(status written by the script, result written by the step itself), by step name: the last of each."""
    statuses = {r["step"]: r for r in records if "status" in r}
    results = {
        r["step"]: r for r in records if "status" not in r and "variant" not in r and r.get("step") in STEPS
    }
    return statuses, results


def steps_section(statuses: dict[str, dict], results: dict[str, dict]) -> str:
    rows = []
    for name, what in STEPS.items():
        status = statuses.get(name, {"status": "not run", "seconds": "", "limit_s": ""})
        note = (
            status.get("note") or results.get(name, {}).get("skipped") or results.get(name, {}).get("error")
        )
        rows.append([name, what, status["status"].upper(), status["seconds"], status["limit_s"], note or ""])
    return markdown_table(["step", "what", "status", "seconds", "limit s", "note"], rows)


def figures_section(records: list[dict[str, Any]], results: dict[str, dict], out: Path, mode: str) -> str:
    figures = check_figures.gpu_check_figures(records)
    serve_runs, large_runs = read_runs(out / "bench_serve.json"), read_runs(out / "bench_large.json")
    large_preset = PLANS[mode].large_preset
    rows = check_figures.kernel_rows(figures) + check_figures.serving_rows(figures, serve_runs)
    if large_runs:
        numbers = check_figures.model_numbers(large_preset)
        large = results.get("large", {})
        budget = large.get("model_info", {}).get("max_num_batched_tokens")
        rows += check_figures.large_rows(figures, large_runs, numbers, large.get("baseline_runs", []), budget)
    ceilings = figures.get("ceilings")
    lines = []
    if ceilings:
        copy, matmul = ceilings["copy_bytes_per_s"] / 1e9, ceilings["bf16_matmul_flops_per_s"] / 1e12
        lines.append(
            f"Ceilings measured in this run: copy {copy:.0f} GB/s (read + write), "
            f"bf16 matrix product {matmul:.0f} TFLOP/s."
        )
    none = "No figures: the steps that measure them did not record any."
    lines.append(markdown_table(check_figures.HEADERS, rows) if rows else none)
    lines.append(
        "The 1b graph step is timed at a 512-token context (scripts/gpu_check.py); the sweep's requests "
        "run at 128-256. Floors and FLOP counts: sluice/benchmarks/gpu/check_figures.py."
    )
    prompt_profile = results.get("large", {}).get("prompt_profile")
    if prompt_profile is not None:
        lines.append(large_prompt_profile_text(prompt_profile, PLANS[mode]))
    return "\n\n".join(lines)


def large_prompt_profile_text(summary: dict[str, Any], plan: Plan) -> str:
    """The large step's profile of one prompt's first forward step: the kernels a TTFT is made of."""
    title = (
        f"**Where the {plan.large_preset} TTFT goes: one {plan.large_profile.prompt_len}-token prompt's "
        f"first step** (the engine core's torch.profiler, OUT/profiles/large/)"
    )
    if "error" in summary:
        return f"{title}: not profiled ({summary['error']})"
    return profile_table(title, summary)


def attention_kernels_section(records: list[dict[str, Any]], mode: str) -> str:
    """scripts/gpu_check.py's FP8-KV kernel rows and the best config per shape of its tile sweep."""
    if mode == "cpu":
        return "CUDA only: not measured in the CPU mode."
    sections = [r for r in records if r.get("step") == "gpu_check"]
    fp8 = [r["figures"] for r in sections if r.get("section") == "kv_fp8"]
    sweep = [r["figures"] for r in sections if r.get("section") == "attention_sweep"]
    lines = []
    if fp8:
        headers = [
            "kernel",
            "shape",
            "bf16 ms",
            "fp8 ms",
            "fp8 speedup",
            "bf16",
            "fp8",
            "unit",
            "fp8 vs bf16",
        ]
        rows = [
            [r["kernel"], r["shape"], f"{r['bf16_ms']:.4f}", f"{r['fp8_ms']:.4f}", f"{r['fp8_speedup']:.2f}x",
             f"{r['bf16_rate']:.0f}", f"{r['fp8_rate']:.0f}", r["unit"], r["check"]]
            for r in fp8[-1]["rows"]
        ]  # fmt: skip
        lines.append(
            "FP8 (e4m3) KV cache, default configs (and the FP8 decode at bf16's tile):\n\n"
            + markdown_table(headers, rows)
        )
    else:
        lines.append("FP8 KV kernel rows: not measured (the gpu_check step did not reach them).")
    if sweep:
        lines.append(
            "Tile sweep, best config per shape:\n\n" + "\n".join(f"- {r['best_line']}" for r in sweep)
        )
    else:
        lines.append("Tile sweep: not measured (the gpu_check step did not reach it, or it was skipped).")
    return "\n\n".join(lines)


def _ms(metrics: dict[str, Any], name: str, quantile: str) -> str:
    value = (metrics.get(name) or {}).get(quantile)
    return "-" if value is None else f"{value * 1e3:.2f}"


def serving_section(out: Path) -> str:
    runs = read_runs(out / "bench_serve.json")
    if not runs:
        return "No `sluice bench` results (bench_serve.json is missing)."
    rows = []
    for run in runs:
        m = run["metrics"]
        cached = m.get("cached_prompt_tokens", "n/a")
        errors = ", ".join(f"{code}={n}" for code, n in m["errors"].items()) or "none"
        rows.append([run["config"].get("concurrency"), f"{m['num_completed']}/{m['num_requests']}",
                     f"{m['output_throughput']:.0f}", _ms(m, "ttft", "p50"), _ms(m, "tpot", "p50"),
                     _ms(m, "tpot", "p99"), cached, errors])  # fmt: skip
    headers = [
        "concurrency",
        "done",
        "out tok/s",
        "TTFT p50 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "cached",
        "errors",
    ]
    return markdown_table(headers, rows)


def _request_name(seed: int | None) -> str:
    return "greedy" if seed is None else f"seed {seed}, temperature 1"


def structured_timing_line(timed: dict[str, dict]) -> str:
    """The structured step's timed greedy answers: plain, speculating with async scheduling, speculating
    synchronously."""
    plain = timed["plain"]["tpot_ms_median"]
    figures = []
    for name, label in (
        ("plain", "plain (the default scheduling: async on CUDA)"),
        ("speculating", "`--speculative ngram`, async scheduling"),
        ("speculating_sync", "the same, `--no-async-scheduling`"),
    ):
        runs = timed.get(name)
        if runs is None or runs["tpot_ms_median"] is None:
            figures.append(f"{label}: not timed")
            continue
        tpot, first = runs["tpot_ms_median"], runs["answers"][0]
        notes = [f"{first['num_tokens']} tokens"]
        if name != "plain":
            notes.append(f"{first['draft_tokens']} drafts / {first['accepted_draft_tokens']} accepted")
            if plain:
                notes.append(f"{tpot / plain:.2f}x plain")
        figures.append(f"{label} {tpot:.3f} ms ({', '.join(notes)})")
    count = len(timed["plain"]["answers"])
    return (
        f"**TPOT of the greedy JSON answer** (median of {count} answers a server, the server's timings): "
        + "; ".join(figures)
    )


def checks_section(results: dict[str, dict]) -> str:
    parts = []
    speculative = results.get("speculative")
    if speculative and "comparison" in speculative:
        parts.append(
            "**Speculative decoding (ngram) vs plain greedy, one request at a time:** "
            + comparison_line(
                speculative["comparison"],
                f"; {speculative.get('draft_tokens', 0)} draft tokens verified, "
                f"{speculative.get('accepted_draft_tokens', 0)} accepted",
            )
        )
    structured = results.get("structured")
    if structured and "answers" in structured:
        rows = [
            [
                _request_name(a["seed"]),
                f"`{a['text']}`",
                "; ".join(a["errors"]) or "valid",
                a["cached_tokens"],
            ]
            for a in structured["answers"]
        ]
        parts.append(
            f"**Constrained output (JSON schema), SmolLM2's tokenizer on the preset "
            f"(vocab_size {structured['vocab_size']}):**\n\n"
            + markdown_table(["request", "output", "schema", "cached prompt tokens"], rows)
        )
    if structured and "speculating" in structured:
        rows = [
            [
                _request_name(a["seed"]),
                f"`{a['text']}`",
                "; ".join(a["errors"]) or "valid",
                f"{a['draft_tokens']} / {a['accepted_draft_tokens']}",
            ]
            for a in structured["speculating"]
        ]
        same = "the same" if structured["speculating_greedy_same"] else "NOT the same"
        parts.append(
            f"**The same, served with `--speculative ngram`** (greedy answer {same} as without):\n\n"
            + markdown_table(["request", "output", "schema", "drafts / accepted"], rows)
        )
    if structured and "timed" in structured:
        parts.append(structured_timing_line(structured["timed"]))
    tensor_parallel = results.get("tensor_parallel", {})
    tp_line = tensor_parallel.get("skipped") or tensor_parallel.get("error") or "not run"
    if "comparison" in tensor_parallel:
        tp_line = "TP=2 vs TP=1 greedy: " + comparison_line(tensor_parallel["comparison"])
    parts.append(f"**Tensor parallelism (issue 35):** {tp_line}")
    ready = {name: r["ready_s"] for name, r in results.items() if r.get("ready_s")}
    if ready:
        parts.append("**Server start to ready, s:** " + ", ".join(f"{k} {v}" for k, v in ready.items()))
    return "\n\n".join(parts)


REPORT_STEP = "report"  # the step name of the record that says where the steps ran (`machine_record`)


def machine_record(mode: str, wall_s: float, budget_s: float) -> dict[str, Any]:
    """This machine's device (its card's UUID on a GPU), the versions that matter (on a GPU, also whether
    the kernels use PDL), the date, and the call's wall time and budget: the record of REPORT_STEP."""
    import torch

    gpu = mode == "gpu" and torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else "CPU"
    uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "")) if gpu else ""
    card = uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}"  # as `nvidia-smi -L` names it
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    cuda = torch.version.cuda or "none"
    versions = (
        f"torch {torch.__version__}, CUDA {cuda}, triton {triton_version}, Python {sys.version.split()[0]}"
    )
    if gpu:
        from sluice.kernels.dependent_launch import dependent_launch

        versions += (
            f", programmatic dependent launch {'on' if dependent_launch(torch.device('cuda')) else 'off'}"
        )
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return {
        "step": REPORT_STEP, "mode": mode, "device": device, "card": card, "versions": versions,
        "date": date, "wall_s": wall_s, "budget_s": budget_s,
    }  # fmt: skip


def report_head(runs: list[dict[str, Any]]) -> tuple[str, str]:
    """The report's device, and its line on where and how long the steps ran, from the machine records of
    the calls it joins (one, or several on one lease: `merge_calls`, which stands an `unrecorded` record
    for a call whose report was never built)."""
    recorded = [run for run in runs if not run.get("unrecorded")]
    if not recorded:
        return "unrecorded machine", "No call recorded its machine (none built its report there)."
    first = recorded[0]
    if len(runs) == 1:
        timing = f"{first['wall_s']:.0f} s of a {first['budget_s']:.0f} s budget"
    else:
        calls = ", ".join(
            "unrecorded" if run.get("unrecorded") else f"{run['wall_s']:.0f} s of {run['budget_s']:.0f}"
            for run in runs
        )
        timing = f"{len(runs)} calls: {calls}"
    cards = list(dict.fromkeys(run["card"] for run in recorded))
    if cards != [""]:
        timing += f"; card {cards[0]}" if len(cards) == 1 else f"; NOT one card: {', '.join(cards)}"
    return first["device"], f"{first['date']}; mode {first['mode']}; {first['versions']}; {timing}."


def build_report(out: Path, mode: str, wall_s: float, budget_s: float) -> tuple[str, bool]:
    """The report's text and whether every step passed or was skipped. Its head is the machine records'
    in results.jsonl where there are any, else this machine's with `wall_s` and `budget_s`."""
    records = read_results(out)
    statuses, results = step_records(records)
    ok = not any(s["status"] in FAILING for s in statuses.values())
    runs = [r for r in records if r.get("step") == REPORT_STEP] or [machine_record(mode, wall_s, budget_s)]
    device, head = report_head(runs)
    gpu_check = out / "gpu_check.md"
    parts = [
        f"# Sluice GPU check: {device}: {'PASS' if ok else 'FAIL'}",
        head,
        "## Steps\n\n" + steps_section(statuses, results),
        "## Figures against their limits and issue 33's goals\n\n"
        + figures_section(records, results, out, mode),
        "## Attention kernels: FP8 KV cache, tile sweep (tables in gpu_check.md)\n\n"
        + attention_kernels_section(records, mode),
        "## Serving over gRPC (`sluice bench`, bench_serve.json)\n\n" + serving_section(out),
        "## FP8 (issue 34): bf16 vs fp8 weights vs fp8 weights + fp8 KV\n\n"
        + fp8_section(records, statuses, results, out, mode),
        "## FP8 on the llama-3-8b shape (issue 34)\n\n"
        + fp8_large_section(records, statuses, results, out, mode),
        "## Async scheduling (issue 33): --async-scheduling vs synchronous\n\n"
        + async_section(records, statuses, results, out, mode),
        "## Checks\n\n" + checks_section(results),
        "Logs: steps.log (every step's output), servers.log (every server's). Details of the kernel-level "
        "sections: gpu_check.md"
        + ("" if gpu_check.is_file() else " (not written: the step did not run)")
        + ".",
    ]
    return "\n\n".join(parts) + "\n", ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--mode", choices=tuple(PLANS), default="gpu")
    parser.add_argument("--wall-s", type=float, default=0.0)
    parser.add_argument("--budget-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not (out / RESULTS).is_file():
        print(f"check_report: {out / RESULTS} does not exist", file=sys.stderr)
        return 1
    if not any(r.get("step") == REPORT_STEP for r in read_results(out)):
        # The first build records this machine, where it can be the one that ran the steps: not a GPU
        # call's rebuilt on a machine without one (an older call's folder, which has no record).
        machine = machine_record(args.mode, args.wall_s, args.budget_s)
        if args.mode == "cpu" or machine["device"] != "CPU":
            append_result(out, machine)
    text, ok = build_report(out, args.mode, args.wall_s, args.budget_s)
    (out / "report.md").write_text(text, encoding="utf-8")
    print(f"wrote {out / 'report.md'}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
