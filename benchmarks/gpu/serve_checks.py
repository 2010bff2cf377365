"""`sluice serve` on the GPU: the server steps of `scripts/gpu_check.sh` (c to h), one per command.

    python -m sluice.benchmarks.gpu.serve_checks STEP --out OUT [--mode gpu|cpu] [--tokenizer-dir DIR]

serve_bench      (c) `sluice serve --preset llama-3.2-1b --dtype bfloat16` answers over gRPC: greedy
                 outputs of fixed prompts (the reference of d and f), then `sluice bench --sweep 1,16,64`
                 (JSON kept as OUT/bench_serve.json)
speculative      (d) the same server with `--speculative ngram`: greedy outputs equal (c)'s
structured       (e) a JSON-schema request: the preset with SmolLM2's tokenizer borrowed
                 (sluice.benchmarks.gpu.borrowed_tokenizer), output parsed and checked against the schema;
                 then served with `--speculative ngram`, with and without async scheduling: the greedy
                 answer's TPOT on each of the three servers
tensor_parallel  (f) `--tensor-parallel-size 2` against (c)'s greedy outputs, where there are 2 GPUs and
                 the flag exists (issue 35); else skipped with the reason
fp8              (g) the preset with `--quantization fp8`, then with `--kv-cache-dtype fp8` too (issue 34):
                 each server's greedy outputs set against (c)'s, its KV blocks, `sluice bench` at
                 concurrency 1 and 64 (its runs kept in its record, one per server as it finishes)
large            (h) llama-3-8b shape (prefix caching on, fresh prompts): batch-1 TPOT and the TTFT of
                 4096-token prompts (JSON kept as OUT/bench_large.json), then the same on a server with
                 the 2048-token step budget GPUs had before 2026-11-30 (its runs in the step's record:
                 each prompt in two steps, against one at the default 8192); in the CPU mode, the tiny
                 preset
fp8_large        (i) the large step's shape served four times: bf16, fp8's two servers, then fp8 in 128 x 128
                 blocks made at load, each as in (g)
                 but set against the first (its own reference), the same `sluice bench` prompts on each

The servers of options a GPU run timed and left off (the async step's skinny linears, fp8_large's FP8
folds) serve only with SLUICE_GPU_CHECK_OFF_OPTIONS=1 (`step_context.plan_for`).

Each step appends one JSON line to OUT/results.jsonl and exits 0 (passed), 1 (failed) or 3 (skipped).
The CPU mode runs the same steps on the `tiny` preset in float32, so a CPU test covers this code.

This module is the step table and the steps around serve_bench's server (the reference); the steps of
variant servers (fp8, async, fp8_large) are in `sluice.benchmarks.gpu.variant_servers`, and what every step
runs with (the mode's plan, its servers, the client calls) in `sluice.benchmarks.gpu.step_context`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sluice.benchmarks.gpu import greedy_compare
from sluice.benchmarks.gpu.borrowed_tokenizer import write_model_dir
from sluice.benchmarks.gpu.step_context import (
    PLANS,
    RPC_TIMEOUT_S,
    StepContext,
    append_result,
    bench_runs,
    greedy_outputs,
    model_info,
    plan_for,
    run_bench,
)
from sluice.benchmarks.gpu.step_profiles import PROFILES_DIR, profile_server
from sluice.benchmarks.gpu.structured_request import SCHEMA, schema_errors
from sluice.benchmarks.gpu.variant_servers import draft_counts, step_async, step_fp8, step_fp8_large
from sluice.client import Client, generate_request
from sluice.engine.config import DEFAULT_STEP_BUDGET

STEP_NAMES = ("serve_bench", "speculative", "structured", "tensor_parallel", "fp8", "async", "large",
              "fp8_large")  # fmt: skip
EXIT_PASSED, EXIT_FAILED, EXIT_SKIPPED = 0, 1, 3


def step_serve_bench(ctx: StepContext) -> dict[str, Any]:
    plan = ctx.plan
    with ctx.server(plan.serve_args()) as server, Client(server.target) as client:
        info = model_info(client)
        prompts = greedy_compare.greedy_prompts(plan.greedy_prompts, info["vocab_size"])
        greedy = greedy_outputs(client, prompts, plan.greedy_tokens)
        sweep = ["--sweep", plan.sweep, "--num-requests", str(plan.num_requests)]
        lengths = ["--input-len", str(plan.input_len), "--output-len", str(plan.output_len)]
        bench_rc = run_bench(server.target, [*sweep, *lengths], ctx.out / "bench_serve.json")
    complete = all(len(sample["tokens"]) == plan.greedy_tokens for sample in greedy)
    return {
        "ok": bench_rc == 0 and complete, "preset": plan.preset, "dtype": plan.dtype,
        "model_info": info, "bench_json": "bench_serve.json",
        "bench_rc": bench_rc, "prompts": prompts, "greedy": greedy,
    }  # fmt: skip


def compare_with_reference(ctx: StepContext, serve_args: Sequence[str]) -> dict[str, Any]:
    """Starts a server with `serve_args`, runs the reference's prompts, compares the greedy outputs."""
    reference = ctx.reference()
    with ctx.server(serve_args) as server, Client(server.target) as client:
        info = model_info(client)
        samples = greedy_outputs(client, reference["prompts"], ctx.plan.greedy_tokens)
    verdicts = greedy_compare.compare_greedy(reference["greedy"], samples, ctx.plan.near_tie_nats)
    summary = greedy_compare.summarize(verdicts)
    return {"model_info": info, "comparison": summary, "greedy": samples}


def step_speculative(ctx: StepContext) -> dict[str, Any]:
    result = compare_with_reference(ctx, ctx.plan.serve_args("--speculative", "ngram"))
    drafts, accepted = draft_counts(result["greedy"])
    speculating = result["model_info"]["speculative_method"] == "ngram" and drafts > 0
    ok = result["comparison"]["mismatch"] == 0 and speculating
    return {**result, "ok": ok, "draft_tokens": drafts, "accepted_draft_tokens": accepted}


def step_structured(ctx: StepContext, tokenizer_dir: Path | None) -> dict[str, Any]:
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        raise RuntimeError(
            f"tokenizer-dir: no SmolLM2 tokenizer at {tokenizer_dir} (`make gpu-wheels` exports it into "
            ".whl/smollm2-tokenizer)"
        )
    plan = ctx.plan
    with tempfile.TemporaryDirectory() as model_dir:
        config = write_model_dir(plan.preset, tokenizer_dir, model_dir)
        args = ["--model", model_dir, "--load-format", "dummy", "--dtype", plan.dtype, "--grace-period", "2"]
        with ctx.server([*args, *plan.extra_serve_args]) as server, Client(server.target) as client:
            info = model_info(client)
            answers = [structured_answer(client, seed) for seed in (None, 1, 2)]
            timed = {"plain": timed_answers(client)}
        # Speculating: the lookup's drafts cut where the grammar refuses them, the keys it forces drafted,
        # each verify row masked on the device. Whether greedy gives the same answer is reported, not
        # required: in bf16 a verify step's rows may part from a decode step's at a near tie (the
        # `speculative` step compares with a tolerance for those; one answer gives nothing to weigh).
        # Served with async scheduling (a verify step sampled once the step before's outputs are out),
        # then without: what speculation costs or saves a constrained answer, and what the overlap saves.
        speculating_args = [*args, "--speculative", "ngram", *plan.extra_serve_args]
        overlapped = [*speculating_args, "--async-scheduling"]
        synchronous = [*speculating_args, "--no-async-scheduling"]
        with ctx.server(overlapped) as server, Client(server.target) as client:
            speculating = [structured_answer(client, seed) for seed in (None, 1)]
            timed["speculating"] = timed_answers(client)
        with ctx.server(synchronous) as server, Client(server.target) as client:
            timed["speculating_sync"] = timed_answers(client)
    same = speculating[0]["text"] == answers[0]["text"]
    drafts, _ = draft_counts(speculating)
    every_answer = answers + speculating + [a for runs in timed.values() for a in runs["answers"]]
    ok = all(not answer["errors"] for answer in every_answer) and drafts > 0
    return {"ok": ok, "vocab_size": config["vocab_size"], "model_info": info, "schema": SCHEMA,
            "answers": answers, "speculating": speculating, "speculating_greedy_same": same,
            "timed": timed}  # fmt: skip


# Greedy answers each structured server times after its checked ones: the same request, so the same answer
# (its prompt from the prefix cache after the first).
TIMED_ANSWERS = 5


def timed_answers(client: Client) -> dict[str, Any]:
    """TIMED_ANSWERS greedy answers one after another; the median of their TPOTs (the server's own
    timings: from the first token to the last, over the tokens after the first)."""
    answers = [structured_answer(client, None) for _ in range(TIMED_ANSWERS)]
    tpots = sorted(a["tpot_ms"] for a in answers if a["tpot_ms"] is not None)
    return {"answers": answers, "tpot_ms_median": tpots[len(tpots) // 2] if tpots else None}


def structured_answer(client: Client, seed: int | None) -> dict[str, Any]:
    """One JSON-schema request from a chat message: greedy (seed None) or sampled at temperature 1."""
    messages = [{"role": "user", "content": "Describe a paint order as JSON."}]
    request = generate_request(
        messages=messages, max_tokens=64, temperature=0.0 if seed is None else 1.0, seed=seed
    )
    request.sampling_params.json_schema = json.dumps(SCHEMA)
    completion = client.complete(request, timeout=RPC_TIMEOUT_S)
    errors = []
    if completion.finish_reason_name != "stop":
        errors.append(f"finish_reason {completion.finish_reason_name!r}, expected 'stop'")
    try:
        errors += schema_errors(json.loads(completion.text))
    except json.JSONDecodeError as error:
        errors.append(f"not JSON: {error}")
    usage, timings, num_tokens = completion.usage, completion.timings, len(completion.token_ids)
    tpot_ms = None
    if timings is not None and num_tokens > 1:
        tpot_ms = round((timings.total_seconds - timings.ttft_seconds) / (num_tokens - 1) * 1e3, 3)
    return {"seed": seed, "text": completion.text, "errors": errors, "num_tokens": num_tokens,
            "tpot_ms": tpot_ms, "cached_tokens": usage.cached_tokens if usage else 0,
            "draft_tokens": usage.draft_tokens if usage else 0,
            "accepted_draft_tokens": usage.accepted_draft_tokens if usage else 0}  # fmt: skip


def step_tensor_parallel(ctx: StepContext) -> dict[str, Any]:
    import torch

    from sluice.service import serve_command

    gpus = torch.cuda.device_count()
    serve_parser = argparse.ArgumentParser()
    serve_command.configure(serve_parser)
    has_flag = not serve_parser.parse_known_args(["--tensor-parallel-size", "2"])[1]
    if gpus < 2:
        return {"skipped": f"needs 2 GPUs, this machine has {gpus}"}
    if not has_flag:
        return {"skipped": "needs `sluice serve --tensor-parallel-size` (issue 35), not in this build"}
    result = compare_with_reference(ctx, ctx.plan.serve_args("--tensor-parallel-size", "2"))
    return {**result, "ok": result["comparison"]["mismatch"] == 0, "gpus": gpus}


def step_large(ctx: StepContext) -> dict[str, Any]:
    """The 8b shape as served by default (on CUDA with async scheduling since 2026-11-26; the H100 run 1
    figure, 7.25 ms batch-1 TPOT, was synchronous): batch-1 TPOT and TTFT of long prompts. Then the same
    bench on a server with the step budget of every GPU before 2026-11-30 (`DEFAULT_STEP_BUDGET`, 2048
    tokens; the default on GPUs of 70 GiB or more is 8192 since): the TTFT of a prompt in two steps
    against one, in the same run. After the first server's bench, one more prompt of the bench's length is
    profiled over its first forward step (`plan.large_profile`): where the TTFT's device time goes."""
    plan = ctx.plan
    args = [
        "--preset",
        plan.large_preset,
        "--dtype",
        plan.dtype,
        "--grace-period",
        "2",
    ]
    profile_dir = (ctx.out / PROFILES_DIR).resolve()
    with ctx.server([*args, "--profile-dir", str(profile_dir)]) as server, Client(server.target) as client:
        info = model_info(client)
        bench_rc = run_bench(server.target, plan.large_bench, ctx.out / "bench_large.json")
        profiles = profile_server(server.target, profile_dir, ctx.step, plan.large_profile, info)
    # its runs go in this step's record: OUT holds at most 8 files that come back from a device call
    baseline_args = [*args, "--max-num-batched-tokens", str(DEFAULT_STEP_BUDGET)]
    with ctx.server(baseline_args) as server, Client(server.target) as client:
        baseline_info = model_info(client)
        baseline_rc, baseline_runs = bench_runs(server.target, plan.large_bench)
    return {"ok": bench_rc == 0 and baseline_rc == 0, "preset": plan.large_preset, "model_info": info,
            "bench_json": "bench_large.json", "bench_rc": bench_rc, "baseline_model_info": baseline_info,
            "baseline_bench_rc": baseline_rc, "baseline_runs": baseline_runs,
            "prompt_profile": profiles[f"prefill{plan.large_profile.prefill_batch}"]}  # fmt: skip


def run_step(step: str, out: Path, mode: str, tokenizer_dir: Path | None) -> int:
    ctx = StepContext(out, plan_for(mode), step)
    steps = {
        "serve_bench": lambda: step_serve_bench(ctx),
        "speculative": lambda: step_speculative(ctx),
        "structured": lambda: step_structured(ctx, tokenizer_dir),
        "tensor_parallel": lambda: step_tensor_parallel(ctx),
        "fp8": lambda: step_fp8(ctx),
        "async": lambda: step_async(ctx),
        "large": lambda: step_large(ctx),
        "fp8_large": lambda: step_fp8_large(ctx),
    }
    try:
        result = steps[step]()
    except Exception as error:  # noqa: BLE001 (recorded, and the step fails)
        result = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        print(f"{step}: {result['error']}", file=sys.stderr)
    append_result(out, {"step": step, "mode": mode, "ready_s": ctx.ready_s, **result})
    if "skipped" in result:
        print(f"{step}: skipped: {result['skipped']}")
        return EXIT_SKIPPED
    print(f"{step}: {'PASS' if result['ok'] else 'FAIL'}")
    return EXIT_PASSED if result["ok"] else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "step",
        choices=STEP_NAMES,
    )
    parser.add_argument("--out", required=True, help="the GPU check's output folder")
    parser.add_argument("--mode", choices=tuple(PLANS), default="gpu")
    parser.add_argument("--tokenizer-dir", default=None, help="SmolLM2's tokenizer (structured step)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else None
    return run_step(args.step, out, args.mode, tokenizer_dir)


if __name__ == "__main__":
    sys.exit(main())
