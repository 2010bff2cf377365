"""`sluice serve` on the GPU: the server steps of `scripts/gpu_check.sh` (c to h), one per command.

    python -m sluice.benchmarks.gpu.serve_checks STEP --out OUT [--mode gpu|cpu] [--tokenizer-dir DIR]

serve_bench      (c) `sluice serve --preset llama-3.2-1b --dtype bfloat16` answers over gRPC: greedy
                 outputs of fixed prompts (the reference of d and f), then `sluice bench --sweep 1,16,64`
                 (JSON kept as OUT/bench_serve.json)
speculative      (d) the same server with `--speculative ngram`: greedy outputs equal (c)'s
structured       (e) a JSON-schema request: the preset with SmolLM2's tokenizer borrowed
                 (sluice.benchmarks.gpu.borrowed_tokenizer), output parsed and checked against the schema
tensor_parallel  (f) `--tensor-parallel-size 2` against (c)'s greedy outputs, where there are 2 GPUs and
                 the flag exists (issue 35); else skipped with the reason
fp8              (g) the preset with `--quantization fp8`, then with `--kv-cache-dtype fp8` too (issue 34):
                 each server's greedy outputs set against (c)'s, its KV blocks, `sluice bench` at
                 concurrency 1 and 64 (its runs kept in its record, one per server as it finishes)
large            (h) llama-3-8b shape, no prefix caching: batch-1 TPOT and the TTFT of 4096-token prompts
                 (JSON kept as OUT/bench_large.json); in the CPU mode, the tiny preset
fp8_large        (i) the large step's shape served three times: bf16, then fp8's two servers, each as in (g)
                 but set against the first (its own reference), the same `sluice bench` prompts on each

Each step appends one JSON line to OUT/results.jsonl and exits 0 (passed), 1 (failed) or 3 (skipped).
The CPU mode runs the same steps on the `tiny` preset in float32, so a CPU test covers this code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.benchmarks.gpu import greedy_compare
from sluice.benchmarks.gpu.borrowed_tokenizer import write_model_dir
from sluice.benchmarks.gpu.structured_request import SCHEMA, schema_errors
from sluice.benchmarks.serving.server_process import ServerProcess
from sluice.client import Client, Completion, generate_request

STEP_NAMES = ("serve_bench", "speculative", "structured", "tensor_parallel", "fp8", "async", "large",
              "fp8_large")  # fmt: skip
RESULTS = "results.jsonl"
SERVERS_LOG = "servers.log"
EXIT_PASSED, EXIT_FAILED, EXIT_SKIPPED = 0, 1, 3
TOP_LOGPROBS = 5
RPC_TIMEOUT_S = 120.0
CORE_EXIT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Plan:
    """What the steps run in one mode."""

    preset: str
    dtype: str
    extra_serve_args: tuple[str, ...]
    sweep: str
    num_requests: int
    input_len: int
    output_len: int
    greedy_prompts: int
    greedy_tokens: int
    near_tie_nats: float  # see greedy_compare: bf16 rounds far more than float32
    variant_bench: tuple[
        tuple[int, int], ...
    ]  # fp8/async servers' `sluice bench` runs: (concurrency, requests)
    large_preset: str  # the large step's shape (the CPU mode runs it on tiny)
    large_bench: tuple[str, ...]

    def serve_args(self, *extra: str, preset: str | None = None) -> list[str]:
        # The plan's preset (or `preset`). Prefix caching stays on, as served: every run of `sluice bench`
        # draws its own prompts, and the report shows each run's cached prompt tokens (0 unless something
        # repeats a prompt). Scheduling is pinned synchronous, as every earlier run measured it (the default
        # became async on CUDA on 2026-11-26): the comparisons stay like for like, and the async step adds
        # --async-scheduling after these (the last flag wins).
        base = ["--preset", preset or self.preset, "--dtype", self.dtype, "--grace-period", "2"]
        base.append("--no-async-scheduling")
        return [*base, *self.extra_serve_args, *extra]


PLANS = {
    "gpu": Plan(
        preset="llama-3.2-1b", dtype="bfloat16", extra_serve_args=(), sweep="1,16,64", num_requests=64,
        input_len=128, output_len=128, greedy_prompts=8, greedy_tokens=32, near_tie_nats=0.1,
        variant_bench=((1, 8), (64, 64)), large_preset="llama-3-8b",
        large_bench=("--concurrency", "1", "--num-requests", "6", "--input-len", "4096",
                     "--output-len", "64"),
    ),
    "cpu": Plan(
        preset="tiny", dtype="float32", extra_serve_args=("--kv-cache-memory", "256MiB"), sweep="1,16,64",
        num_requests=4, input_len=16, output_len=4, greedy_prompts=3, greedy_tokens=8, near_tie_nats=1e-3,
        variant_bench=((1, 2), (64, 4)), large_preset="tiny",
        large_bench=("--concurrency", "1", "--num-requests", "2", "--input-len", "24", "--output-len", "3"),
    ),
}  # fmt: skip


class StepContext:
    """The output folder, the mode's plan, and the servers the step starts (their logs in servers.log)."""

    def __init__(self, out: Path, plan: Plan, step: str) -> None:
        self.out, self.plan, self.step = out, plan, step
        self.ready_s: list[float] = []  # seconds from start to ready, of each server started

    @contextlib.contextmanager
    def server(self, serve_args: Sequence[str]) -> Iterator[ServerProcess]:
        """A `sluice serve` on a loopback port; on leaving, stopped, and its engine core gone too, so the
        next server finds the GPU's memory free."""
        with (self.out / SERVERS_LOG).open("a", encoding="utf-8") as log:
            log.write(f"\n==== {self.step}: sluice serve {' '.join(serve_args)}\n")
            log.flush()
            started = time.monotonic()
            server = ServerProcess(serve_args, stderr=log)  # the server keeps its own descriptor
        self.ready_s.append(round(time.monotonic() - started, 1))
        try:
            yield server
        finally:
            server.stop()
            wait_gone(server.core_pid, CORE_EXIT_TIMEOUT_S)

    def reference(self) -> dict[str, Any]:
        """serve_bench's record: the greedy outputs the other servers must reproduce."""
        for record in reversed(read_results(self.out)):
            if record.get("step") == "serve_bench" and record.get("greedy"):
                return record
        raise RuntimeError("no greedy outputs recorded by the serve_bench step (it failed or did not run)")


def wait_gone(pid: int, timeout: float) -> bool:
    """Waits until process `pid` no longer exists; False if it still does after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":  # exited; its memory is freed, whoever reaps it
            return True
        time.sleep(0.1)
    return False


def read_results(out: Path) -> list[dict[str, Any]]:
    path = out / RESULTS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def model_info(client: Client) -> dict[str, Any]:
    info = client.model_info(timeout=RPC_TIMEOUT_S)
    return {
        "model_name": info.model_name,
        "vocab_size": info.vocab_size,
        "max_model_len": info.max_model_len,
        "kv_capacity_tokens": info.kv_capacity_tokens,
        "num_kv_blocks": info.num_kv_blocks,
        "speculative_method": info.speculative_method,
    }


def sample_record(completion: Completion) -> dict[str, Any]:
    usage = completion.usage
    return {
        "tokens": list(completion.token_ids),
        "top": [[[t.token_id, t.logprob] for t in lp.top] for lp in completion.logprobs],
        "finish_reason": completion.finish_reason_name,
        "draft_tokens": usage.draft_tokens if usage else 0,
        "accepted_draft_tokens": usage.accepted_draft_tokens if usage else 0,
    }


def greedy_outputs(client: Client, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """One request at a time (batch 1 on both servers compared), temperature 0, EOS ignored."""
    samples = []
    for prompt in prompts:
        request = generate_request(
            token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS
        )
        samples.append(sample_record(client.complete(request, timeout=RPC_TIMEOUT_S)))
    return samples


def run_bench(target: str, args: Sequence[str], json_path: Path) -> int:
    """`sluice bench` as a user runs it; its table goes to this step's log."""
    command = [sys.executable, "-m", "sluice.service.cli", "bench", "--target", target, "--no-progress"]
    return subprocess.run([*command, *args, "--json", str(json_path)], check=False).returncode


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
    drafts = sum(sample["draft_tokens"] for sample in result["greedy"])
    accepted = sum(sample["accepted_draft_tokens"] for sample in result["greedy"])
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
    ok = all(not answer["errors"] for answer in answers)
    return {"ok": ok, "vocab_size": config["vocab_size"], "model_info": info,
            "schema": SCHEMA, "answers": answers}  # fmt: skip


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
    usage = completion.usage
    return {"seed": seed, "text": completion.text, "errors": errors,
            "cached_tokens": usage.cached_tokens if usage else 0}  # fmt: skip


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


FP8_VARIANTS = {  # the fp8 step's servers, in order: name -> the serve arguments beside the plan's
    "fp8": ("--quantization", "fp8"),
    "fp8_kv": ("--quantization", "fp8", "--kv-cache-dtype", "fp8"),
}
SERVER_NOTES = ("KV cache:", "attention backend")  # the server log lines an fp8 record keeps


def step_fp8(ctx: StepContext) -> dict[str, Any]:
    """Each FP8 variant on a server of its own; a record per server appended as it finishes, so a step
    killed at its limit keeps the first. Greedy outputs need not equal bf16's: agreement is reported."""
    reference = ctx.reference()
    records = [variant_server(ctx, reference, name, args) for name, args in FP8_VARIANTS.items()]
    return {"ok": all(r["ok"] for r in records), "variants": list(FP8_VARIANTS)}


def variant_server(
    ctx: StepContext,
    reference: dict[str, Any] | None,
    name: str,
    extra: Sequence[str],
    preset: str | None = None,
) -> dict:
    """One server of the preset (or `preset`) with `extra` arguments: its greedy outputs against
    `reference`'s (serve_bench's, or a record of this function's), its KV blocks, `sluice bench` at
    concurrency 1 and 64 (the plan's variant_bench runs); the record is appended to results.jsonl at once,
    as variant `name` of this step. With no `reference`, this server is one: it draws the greedy prompts and
    keeps them in its record, and compares with nothing."""
    plan = ctx.plan
    serve_args = plan.serve_args(*extra, preset=preset)
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
    log = log_path.read_bytes()[log_start:].decode(errors="replace").splitlines()
    complete = all(len(sample["tokens"]) == plan.greedy_tokens for sample in samples)
    record = {
        "step": ctx.step, "variant": name, "ok": complete and not any(bench_rcs), "serve_args": serve_args,
        "model_info": info, "bench_rc": bench_rcs, "runs": runs,
        "server_notes": [line for line in log if any(note in line for note in SERVER_NOTES)],
        "greedy": samples,
    }  # fmt: skip
    if reference is None:
        record["prompts"] = prompts
    else:
        verdicts = greedy_compare.compare_greedy(reference["greedy"], samples, plan.near_tie_nats)
        record["comparison"] = greedy_compare.summarize(verdicts)
        record["agreement"] = greedy_compare.agreement(reference["greedy"], samples)
    with (ctx.out / RESULTS).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return record


def variant_bench_runs(target: str, plan: Plan) -> tuple[list[int], list[dict[str, Any]]]:
    """`sluice bench` once per (concurrency, requests) of the plan, at serve_bench's lengths; each run its
    own --seed, so its prompts are its own (none served from another run's cache). Exit statuses, and
    the runs without their per-request timelines."""
    lengths = ["--input-len", str(plan.input_len), "--output-len", str(plan.output_len)]
    rcs, runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (concurrency, requests) in enumerate(plan.variant_bench, start=1):
            path = Path(tmp) / f"{concurrency}.json"
            load = ["--concurrency", str(concurrency), "--num-requests", str(requests), "--seed", str(seed)]
            rcs.append(run_bench(target, [*load, *lengths], path))
            runs += json.loads(path.read_text())["runs"] if path.is_file() else []
    return rcs, [{key: value for key, value in run.items() if key != "requests"} for run in runs]


def step_fp8_large(ctx: StepContext) -> dict[str, Any]:
    """The fp8 step's servers on the large step's shape (issue 34's batch-1 target is set on llama-3-8b),
    after a bf16 server of that shape, their reference: greedy outputs and `sluice bench` (the same seeds,
    so the same prompts, on each) against it. A record per server appended as it finishes."""
    preset = ctx.plan.large_preset
    reference = variant_server(ctx, None, "bf16", (), preset=preset)
    records = [variant_server(ctx, reference, name, args, preset) for name, args in FP8_VARIANTS.items()]
    ok = reference["ok"] and all(r["ok"] for r in records)
    return {"ok": ok, "preset": preset, "variants": ["bf16", *FP8_VARIANTS]}


def step_async(ctx: StepContext) -> dict[str, Any]:
    """The preset with `--async-scheduling` (issue 33): the same greedy outputs as serve_bench's synchronous
    server (near ties aside: both run the same kernels on the same batches), and `sluice bench` at 1 and 64
    against serve_bench's sweep."""
    record = variant_server(ctx, ctx.reference(), "async", ("--async-scheduling",))
    return {"ok": record["ok"] and record["comparison"]["mismatch"] == 0, "variants": ["async"]}


def step_large(ctx: StepContext) -> dict[str, Any]:
    """The 8b shape as served by default (on CUDA with async scheduling since 2026-11-26; the H100 run 1
    figure, 7.25 ms batch-1 TPOT, was synchronous): batch-1 TPOT and TTFT of long prompts."""
    plan = ctx.plan
    args = [
        "--preset",
        plan.large_preset,
        "--dtype",
        plan.dtype,
        "--grace-period",
        "2",
    ]
    with ctx.server(args) as server, Client(server.target) as client:
        info = model_info(client)
        bench_rc = run_bench(server.target, plan.large_bench, ctx.out / "bench_large.json")
    return {"ok": bench_rc == 0, "preset": plan.large_preset, "model_info": info,
            "bench_json": "bench_large.json", "bench_rc": bench_rc}  # fmt: skip


def run_step(step: str, out: Path, mode: str, tokenizer_dir: Path | None) -> int:
    ctx = StepContext(out, PLANS[mode], step)
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
    with (out / RESULTS).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "mode": mode, "ready_s": ctx.ready_s, **result}) + "\n")
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
