"""The GPU check's variant servers: the steps that serve the same preset several ways, one server after
another on the same prompts, each set against a reference server (steps of `serve_checks`).

fp8        (g) the preset with `--quantization fp8`, then with `--kv-cache-dtype fp8` too (issue 34), set
           against serve_bench's server
async      the preset with `--async-scheduling` (issue 33), then, with SLUICE_GPU_CHECK_OFF_OPTIONS=1,
           with `--skinny-linears` too (Sluice's own linears for steps of up to 64 rows: off by default,
           slower in run 16), then, with SLUICE_GPU_CHECK_SPEC_ASYNC=1, with `--speculative ngram` too and
           with it paused from 16 running requests (`SPEC_VARIANTS`), each set against serve_bench's
           synchronous server
fp8_large  (i) the large step's shape served four times (six with SLUICE_GPU_CHECK_OFF_OPTIONS=1), with
           async scheduling: bf16 (the reference, drawing its own prompts), fp8's two servers, with the
           knob on a GPU fp8 with the RMSNorms in the one-row FP8 linears' launches (`--fuse-norm-fp8`:
           `Plan.fp8_norm_serve_args`) and fp8 with SiLU-and-mul in down_proj's too (`--fuse-silu-fp8`,
           `Plan.fp8_fold_serve_args`; both off by default, slower in run 16), then fp8 weights in 128 x
           128 blocks made at load (`--fp8-weight-block 128`: the layout of Qwen3-FP8 / DeepSeek-V3
           checkpoints), last, so that a step cut short keeps issue 34's three

Every variant server is `variant_server`: its greedy outputs of the reference's prompts compared with the
reference's, its KV blocks, `sluice bench` at the plan's concurrencies (the same seeds, so the same prompts,
on each server), the lines of its log that name its KV cache and attention backend, and (fp8_large's
servers) profiles of its decode steps at batch 1 and at the top concurrency (`step_profiles`); its record is
appended to results.jsonl as soon as it finishes (`"variant": name`), so a step killed at its limit keeps
the servers it finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sluice.benchmarks.gpu import greedy_compare
from sluice.benchmarks.gpu.step_context import (
    SERVERS_LOG,
    Plan,
    StepContext,
    append_result,
    bench_runs,
    greedy_outputs,
    model_info,
)
from sluice.benchmarks.gpu.step_profiles import PROFILES_DIR, profile_server
from sluice.client import Client

FP8_VARIANTS = {  # the fp8 step's servers, in order: name -> the serve arguments beside the plan's
    "fp8": ("--quantization", "fp8"),
    "fp8_kv": ("--quantization", "fp8", "--kv-cache-dtype", "fp8"),
}
FP8_BLOCK_ARGS = ("--quantization", "fp8", "--fp8-weight-block", "128")  # fp8_large's last server
# The fp8_large servers schedule as served (async, the CUDA default since 2026-11-26 run 6), all alike;
# runs 3-8 pinned them synchronous, as the plan's other servers still are (`Plan.serve_args`).
LARGE_SCHEDULING = ("--async-scheduling",)
# The server log lines a record keeps: its cache, its attention backend, and any Triton compile after start-up
# (`engine/worker/jit_watch.py`: a step that waited on the JIT).
SERVER_NOTES = ("KV cache:", "attention backend", "while serving (")


def step_fp8(ctx: StepContext) -> dict[str, Any]:
    """Each FP8 variant on a server of its own; a record per server appended as it finishes, so a step
    killed at its limit keeps the first. Greedy outputs need not equal bf16's: agreement is reported."""
    reference = ctx.reference()
    records = [variant_server(ctx, reference, name, args) for name, args in FP8_VARIANTS.items()]
    return {"ok": all(r["ok"] for r in records), "variants": list(FP8_VARIANTS)}


def step_fp8_large(ctx: StepContext) -> dict[str, Any]:
    """The fp8 step's servers, on a GPU two with the norms (then SiLU-and-mul too) in the FP8 linears'
    launches, and the block-wise one on the large step's shape (issue 34's batch-1 target is set on
    llama-3-8b), after a bf16 server of that shape, their reference: greedy outputs and `sluice bench`
    (the same seeds, so the same prompts, on each) against it (`large_variants`). A record per server
    appended as it finishes."""
    preset, variants = ctx.plan.large_preset, large_variants(ctx.plan)
    reference = variant_server(ctx, None, "bf16", LARGE_SCHEDULING, preset=preset, profile=True)
    records = [
        variant_server(ctx, reference, name, (*LARGE_SCHEDULING, *args), preset, profile=True)
        for name, args in variants.items()
    ]
    ok = reference["ok"] and all(r["ok"] for r in records)
    return {"ok": ok, "preset": preset, "variants": ["bf16", *variants]}


def large_variants(plan: Plan) -> dict[str, tuple[str, ...]]:
    """fp8_large's servers after its bf16 one, in order: fp8's, fp8 with the norms in the one-row linears'
    launches and fp8 with SiLU-and-mul in down_proj's too where the plan runs them, then the block-wise
    path (no target of its own)."""
    variants = dict(FP8_VARIANTS)
    if plan.fp8_norm_serve_args is not None:
        variants["fp8_norm"] = (*FP8_VARIANTS["fp8"], *plan.fp8_norm_serve_args)
    if plan.fp8_fold_serve_args is not None:
        variants["fp8_fold"] = (*FP8_VARIANTS["fp8"], *plan.fp8_fold_serve_args)
    variants["fp8_block"] = FP8_BLOCK_ARGS
    return variants


# The async step's speculating servers (`Plan.spec_servers`), after --async-scheduling: n-gram drafts (k = 3)
# in every step, then paused while 16 or more requests run (vLLM's speculative_disable_by_batch_size), whose
# steps at 64 then overlap again.
SPEC_VARIANTS = {
    "async_ngram": ("--speculative", "ngram"),
    "async_ngram_pause": ("--speculative", "ngram", "--speculative-disable-by-batch-size", "16"),
}
# The first speculating server is profiled too (`step_profiles`, ~15 s): a step's wall time against the
# device's busy time, what a verify step's synchronous host work leaves idle.
PROFILED_ASYNC = ("async_ngram",)


def step_async(ctx: StepContext) -> dict[str, Any]:
    """The preset with `--async-scheduling` (issue 33), then with Sluice's skinny linears too, then
    speculating: the first's greedy outputs equal serve_bench's synchronous server's, near ties aside (the
    same kernels on the same batches), as the speculating servers' must, drafts verified; the skinny
    server's are set against them (its bf16 products summed in another order); `sluice bench` at 1 and 64
    against serve_bench's sweep (the others where the plan runs them: `async_variants`), then, with the
    speculating servers, step profiles of `PROFILED_ASYNC`. A record per server appended as it finishes:
    a step killed at its limit keeps the first."""
    reference, variants = ctx.reference(), async_variants(ctx.plan)
    profiled = PROFILED_ASYNC if ctx.plan.spec_servers else ()
    records = {
        name: variant_server(ctx, reference, name, args, profile=name in profiled)
        for name, args in variants.items()
    }
    # the skinny server's greedy outputs are reported, not required equal (bf16 sums in another order can
    # part beyond a near tie; the kernel and parity tests check its numbers)
    speculating = [records[name] for name in SPEC_VARIANTS if name in records]
    ok = all(r["ok"] for r in records.values())
    ok = ok and all(r["comparison"]["mismatch"] == 0 for r in [records["async"], *speculating])
    ok = ok and all(draft_counts(r["greedy"])[0] > 0 for r in speculating)
    return {"ok": ok, "variants": list(variants)}


def async_variants(plan: Plan) -> dict[str, tuple[str, ...]]:
    """The async step's servers, in order: async scheduling, then with Sluice's skinny linears too where
    the plan runs them (`Plan.skinny_serve_args`: not in the CPU mode, nor without the off-options knob),
    then the speculating ones where it runs them (`Plan.spec_servers`)."""
    variants = {"async": ("--async-scheduling",)}
    if plan.skinny_serve_args is not None:
        variants["async_skinny"] = ("--async-scheduling", *plan.skinny_serve_args)
    if plan.spec_servers:
        variants |= {name: ("--async-scheduling", *args) for name, args in SPEC_VARIANTS.items()}
    return variants


def draft_counts(samples: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """Draft tokens verified and accepted over a server's greedy samples."""
    return sum(s["draft_tokens"] for s in samples), sum(s["accepted_draft_tokens"] for s in samples)


def variant_server(
    ctx: StepContext,
    reference: dict[str, Any] | None,
    name: str,
    extra: Sequence[str],
    preset: str | None = None,
    profile: bool = False,
) -> dict:
    """One server of the preset (or `preset`) with `extra` arguments: its greedy outputs against
    `reference`'s (serve_bench's, or a record of this function's), its KV blocks, `sluice bench` at
    concurrency 1 and 64 (the plan's variant_bench runs); the record is appended to results.jsonl at once,
    as variant `name` of this step. With no `reference`, this server is one: it draws the greedy prompts and
    keeps them in its record, and compares with nothing."""
    plan = ctx.plan
    profile_dir = (ctx.out / PROFILES_DIR).resolve()
    profiling = ("--profile-dir", str(profile_dir)) if profile else ()
    serve_args = plan.serve_args(*profiling, *extra, preset=preset)
    log_path = ctx.out / SERVERS_LOG
    log_start = log_path.stat().st_size if log_path.is_file() else 0
    with ctx.server(serve_args) as server, Client(server.target) as client:
        info = model_info(client)
        if reference is None:  # this server is the reference: it draws the prompts
            prompts = greedy_compare.greedy_prompts(plan.greedy_prompts, info["vocab_size"])
        else:
            prompts = reference["prompts"]
        samples = greedy_outputs(client, prompts, plan.greedy_tokens)
        bench_rcs, runs = variant_bench_runs(server.target, plan)
        if profile:  # after the benchmark runs: the profiler's overhead is in none of them
            label = f"{ctx.step}-{name}"
            profiles = profile_server(server.target, profile_dir, label, plan.profiles, info)
    complete = all(len(sample["tokens"]) == plan.greedy_tokens for sample in samples)
    record = {
        "step": ctx.step, "variant": name, "ok": complete and not any(bench_rcs), "serve_args": serve_args,
        "model_info": info, "bench_rc": bench_rcs, "runs": runs,
        "server_notes": server_notes(log_path, log_start), "greedy": samples,
    }  # fmt: skip
    if profile:
        record["profiles"] = profiles
    record.update(set_against(reference, prompts, samples, plan.near_tie_nats))
    append_result(ctx.out, record)
    return record


def server_notes(log_path: Path, log_start: int) -> list[str]:
    """The lines of servers.log after byte `log_start` (one server's) that name its KV cache or attention
    backend."""
    log = log_path.read_bytes()[log_start:].decode(errors="replace").splitlines()
    return [line for line in log if any(note in line for note in SERVER_NOTES)]


def set_against(
    reference: dict[str, Any] | None, prompts: list[list[int]], samples: list[dict], near_tie_nats: float
) -> dict[str, Any]:
    """A reference server's prompts (with no `reference`, the server is one); otherwise how its greedy
    outputs compare with the reference's."""
    if reference is None:
        return {"prompts": prompts}
    verdicts = greedy_compare.compare_greedy(reference["greedy"], samples, near_tie_nats)
    return {
        "comparison": greedy_compare.summarize(verdicts),
        "agreement": greedy_compare.agreement(reference["greedy"], samples),
    }


def variant_bench_runs(target: str, plan: Plan) -> tuple[list[int], list[dict[str, Any]]]:
    """`sluice bench` once per (concurrency, requests) of the plan, at serve_bench's lengths; each run its
    own --seed, so its prompts are its own (none served from another run's cache). Exit statuses, and
    the runs without their per-request timelines."""
    lengths = ["--input-len", str(plan.input_len), "--output-len", str(plan.output_len)]
    rcs, runs = [], []
    for seed, (concurrency, requests) in enumerate(plan.variant_bench, start=1):
        load = ["--concurrency", str(concurrency), "--num-requests", str(requests), "--seed", str(seed)]
        rc, seed_runs = bench_runs(target, [*load, *lengths])
        rcs.append(rc)
        runs += seed_runs
    return rcs, runs
