"""The sections of OUT/report.md on the GPU check's variant servers (`variant_servers`: the fp8, fp8_large
and async steps): each step's servers in a table against their reference server, issue 34's targets (the
FP8 sections) or issue 33's TPOT goal (async), each server's greedy comparison and the log lines it kept;
"Not measured" and why when a step recorded none. The figures and rows come from `fp8_figures`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from sluice.benchmarks.gpu import check_figures, fp8_figures
from sluice.benchmarks.gpu.greedy_compare import comparison_line
from sluice.benchmarks.gpu.markdown_table import markdown_table
from sluice.benchmarks.gpu.step_context import (
    OFF_OPTIONS_ENV,
    PLANS,
    SPEC_ASYNC_ENV,
    Plan,
    plan_for,
    read_runs,
)
from sluice.benchmarks.gpu.step_profiles import profile_tables
from sluice.benchmarks.gpu.variant_servers import SPEC_VARIANTS, async_variants, draft_counts, large_variants

LOG_PREFIX = re.compile(r"^\S+ \S+ [A-Z]+ [\w.]+: ")  # a server log line's "date time LEVEL logger: "


class Baseline(NamedTuple):
    """What a step of variant servers (fp8, async) is set against: serve_bench's server in this mode."""

    plan: Plan
    base: str  # serve_bench's dtype as the report names it: bf16 on a GPU
    reference: fp8_figures.ServerFigures  # from its sweep and its model info
    runs: str  # the variant servers' `sluice bench` runs, in words

    @classmethod
    def of(cls, results: dict[str, dict], out: Path, mode: str) -> Baseline:
        plan = PLANS[mode]
        model_info = results.get("serve_bench", {}).get("model_info")
        return cls(
            plan,
            "bf16" if plan.dtype == "bfloat16" else plan.dtype,
            fp8_figures.ServerFigures.of(read_runs(out / "bench_serve.json"), model_info),
            ", ".join(f"{requests} requests at concurrency {c}" for c, requests in plan.variant_bench),
        )


def not_measured(step: str, statuses: dict[str, dict], results: dict[str, dict]) -> str:
    """Why a step recorded no figures: its status, and its error or the script's note."""
    status = statuses.get(step, {}).get("status", "not run")
    why = results.get(step, {}).get("error") or statuses.get(step, {}).get("note") or ""
    return f"Not measured: the {step} step {status.upper()}" + (f" ({why})." if why else ".")


def fp8_section(
    records: list[dict[str, Any]], statuses: dict[str, dict], results: dict[str, dict], out: Path, mode: str
) -> str:
    """The fp8 step's servers against serve_bench's (bf16 on a GPU), issue 34's targets, what they
    measure, and each server's greedy comparison and KV cache log line."""
    variants = fp8_figures.variant_records(records)
    if not variants:
        return not_measured("fp8", statuses, results)
    plan, base, reference, runs = Baseline.of(results, out, mode)
    intro = (
        f"The {plan.preset} preset ({plan.dtype}) on three servers, one after another: {base} is "
        f"serve_bench's (its sweep), the fp8 ones ran `sluice bench` with {runs}, {plan.input_len} prompt "
        f"and {plan.output_len} output tokens, prompts of their own. In brackets: the ratio to {base}'s."
    )
    table = markdown_table(fp8_figures.TABLE_HEADERS, fp8_figures.table_rows(reference, variants, base))
    shape = fp8_figures.shape_line(plan.preset, "`large` runs that one in bf16 only, `fp8_large` in fp8 too")
    return "\n\n".join(
        [intro, table, *fp8_servers_parts(variants, reference, plan.preset, base, mode, shape)]
    )


def fp8_large_section(
    records: list[dict[str, Any]], statuses: dict[str, dict], results: dict[str, dict], out: Path, mode: str
) -> str:
    """The fp8_large step's servers on the llama-3-8b shape (tiny in the CPU mode): its own bf16 server,
    the reference, then the fp8 ones; the same table, targets and notes as the fp8 section."""
    variants = fp8_figures.variant_records(records, "fp8_large")
    bf16 = variants.pop("bf16", None)
    if bf16 is None:
        return not_measured("fp8_large", statuses, results)
    plan, base, _, runs = Baseline.of(results, out, mode)
    reference = fp8_figures.ServerFigures.of(bf16["runs"], bf16["model_info"])
    labels = served_labels(fp8_figures.LARGE_LABELS, large_variants(plan_for(mode)), variants)
    servers = ", ".join([base, *labels.values()])
    flags = "; ".join(note for name, note in LARGE_FLAG_NOTES.items() if name in labels)
    intro = (
        f"The {plan.large_preset} preset ({plan.dtype}) on {len(labels) + 1} servers of this step, one "
        f"after another, each with `--async-scheduling` (as served on CUDA): {servers}"
        + (f" ({flags})" if flags else "")
        + f"; each ran `sluice bench` with {runs}, {plan.input_len} prompt and "
        f"{plan.output_len} output tokens, the same prompts on each (the same seeds). In brackets: the "
        f"ratio to {base}'s."
    )
    rows = fp8_figures.table_rows(reference, variants, base, labels=labels, base_source="this step's")
    table = markdown_table(fp8_figures.table_headers(base), rows)
    shape = fp8_figures.shape_line(plan.large_preset, "the CPU mode runs this step on the tiny preset")
    parts = fp8_servers_parts(variants, reference, plan.large_preset, base, mode, shape)
    if mode == "gpu" and not {"fp8_norm", "fp8_fold"} & labels.keys():
        parts.insert(0, off_options_line("fp8 weights with the RMSNorms (and SiLU-and-mul) in the linears"))
    profiled = {name: r["profiles"] for name, r in {"bf16": bf16, **variants}.items() if "profiles" in r}
    if profiled:
        parts += [
            f"**Where a step's device time goes** (the engine core's torch.profiler over "
            f"{plan.profiles.num_steps} decode steps of each server once its benchmark runs were over, the "
            "kernels of the CUDA graphs one by one; files in OUT/profiles/, "
            "`sluice.benchmarks.gpu.step_profiles`):",
            *profile_tables(profiled),
        ]
    return "\n\n".join([intro, table, *parts])


# What fp8_large's flags do, for the servers that ran.
LARGE_FLAG_NOTES = {
    "fp8_norm": "RMSNorms in the linears: `--fuse-norm-fp8`, each one-row step's norms made in qkv_proj's "
    "and gate_up_proj's FP8 launches",
    "fp8_fold": "and SiLU-and-mul: `--fuse-silu-fp8` too, its activation made in down_proj's",
    "fp8_block": "128 x 128 blocks: `--fp8-weight-block 128`, made at load, the layout of Qwen3-FP8 "
    "checkpoints",
}


def served_labels(labels: dict[str, str], planned: Iterable[str], variants: dict[str, Any]) -> dict[str, str]:
    """`labels` (in their order) of the servers the plan runs, and of any other that recorded figures (a
    call with `OFF_OPTIONS_ENV` set, its report rebuilt without it by merge_calls)."""
    planned = set(planned)
    return {name: label for name, label in labels.items() if name in planned or name in variants}


def off_options_line(servers: str) -> str:
    return (
        f"The servers of {servers} did not run: off by default since run 16, where they were slower; "
        f"`{OFF_OPTIONS_ENV}=1` serves them."
    )


def fp8_servers_parts(
    variants: dict[str, dict[str, Any]],
    reference: fp8_figures.ServerFigures,
    preset: str,
    base: str,
    mode: str,
    shape_line: str,
) -> list[str]:
    """What an FP8 section says after its table: issue 34's targets against `reference` (`base`'s server),
    the shape, what the fp8-KV server's speed measures, each fp8 server's greedy comparison and log lines."""
    targets = fp8_figures.target_rows(reference, variants, preset, base)
    parts = [
        markdown_table(fp8_figures.TARGET_HEADERS, targets),
        shape_line,
        fp8_figures.backend_note(variants, mode),
    ]
    for name, record in variants.items():
        notes = [LOG_PREFIX.sub("", line) for line in record.get("server_notes", [])]
        parts.append(
            f"**{fp8_figures.LARGE_LABELS[name]} vs {base}, greedy** (need not be equal: another rounding): "
            + comparison_line(record["comparison"])
            + "".join(f"\n- log: `{note}`" for note in notes)
        )
    return parts


ASYNC_LABELS = {
    "async": "--async-scheduling",
    "async_skinny": "--async-scheduling --skinny-linears",
    "async_ngram": "--async-scheduling --speculative ngram",
    "async_ngram_pause": "--async-scheduling --speculative ngram --speculative-disable-by-batch-size 16",
}


def async_section(
    records: list[dict[str, Any]], statuses: dict[str, dict], results: dict[str, dict], out: Path, mode: str
) -> str:
    """The async step's servers against serve_bench's synchronous one: TPOT, throughput, greedy outputs, and
    issue 33's TPOT-at-64 goal against the graph step (the async server's, cuBLAS's linears)."""
    variants = fp8_figures.variant_records(records, "async")
    if not variants:
        return not_measured("async", statuses, results)
    plan, base, reference, runs = Baseline.of(results, out, mode)
    record = variants["async"]
    labels = served_labels(ASYNC_LABELS, async_variants(plan_for(mode)), variants)
    others = []
    if "async_skinny" in labels:
        others.append("the second with Sluice's skinny linears, `--skinny-linears`")
    if any(name in labels for name in SPEC_VARIANTS):
        others.append("the last two speculating, `--speculative ngram`")
    servers = "the `--async-scheduling` server ran"
    if others:
        servers = f"the `--async-scheduling` servers ({'; '.join(others)}) ran"
    parts = [
        f"The {plan.preset} preset ({plan.dtype}): {base} is serve_bench's synchronous server (its sweep); "
        f"{servers} `sluice bench` with {runs}, {plan.input_len} prompt and {plan.output_len} output tokens. "
        f"In brackets: the ratio to {base}'s.",
        markdown_table(
            fp8_figures.TABLE_HEADERS,
            fp8_figures.table_rows(reference, variants, base, labels=labels),
        ),
        "**Greedy, --async-scheduling vs synchronous** (must be equal, near ties aside): "
        + comparison_line(record["comparison"]),
    ]
    if "async_skinny" in variants:
        parts.append(
            "**Greedy, --skinny-linears vs synchronous** (need not be equal: the same products summed in "
            "another order): " + comparison_line(variants["async_skinny"]["comparison"])
        )
    parts += speculating_parts(variants, labels)
    profiled = {labels[name]: r["profiles"] for name, r in variants.items() if "profiles" in r}
    if profiled:
        parts += [
            f"**Where a step's time goes** (the engine core's torch.profiler over {plan.profiles.num_steps} "
            "decode steps of each server once its benchmark runs were over; files in OUT/profiles/): the "
            "wall time a step against the device's busy time, the difference what the device idled (the "
            "profiler's own host work included); its steps verify drafts, their host work between two "
            "forwards:",
            *profile_tables(profiled),
        ]
    goal_rows = check_figures.serving_rows(check_figures.gpu_check_figures(records), record["runs"])
    if goal_rows:  # the same rows as the synchronous server's in the figures section
        parts.append(markdown_table(check_figures.HEADERS, goal_rows))
    if mode == "cpu":
        parts.append(
            "CPU mode: the forward runs on the thread the host work needs, so nothing overlaps here; the "
            "skinny linears' server does not run (their kernels interpreted: minutes for its requests)."
        )
    elif "async_skinny" not in labels:
        parts.append(off_options_line("Sluice's skinny linears (`--skinny-linears`)"))
    return "\n\n".join(parts)


def speculating_parts(variants: dict[str, dict[str, Any]], labels: dict[str, str]) -> list[str]:
    """The async step's speculating servers: each one's greedy comparison and drafts, or why none ran."""
    if not any(name in labels for name in SPEC_VARIANTS):
        return [
            "The speculating servers (`--speculative ngram`, then paused from 16 running requests) did not "
            f"run: `{SPEC_ASYNC_ENV}=1` serves them (~60 s on a GPU, with the first one's profiles)."
        ]
    parts = [
        "Speculating under async scheduling, a step that verifies drafts runs synchronously (its outputs "
        "are sampled on the host before the next step is scheduled: docs/ARCHITECTURE.md); its TPOT against "
        "--async-scheduling's says whether the drafts still pay for the overlap given up, the paused "
        "server's at 64 what pausing gives back. Drafts and accepted drafts: the greedy requests' (batch 1)."
    ]
    for name in SPEC_VARIANTS:
        record = variants.get(name)
        if record is not None:
            drafts, accepted = draft_counts(record["greedy"])
            parts.append(
                f"**Greedy, {labels[name]} vs synchronous** (must be equal, near ties aside): "
                + comparison_line(record["comparison"], f"; {accepted}/{drafts} drafts accepted")
            )
    return parts
