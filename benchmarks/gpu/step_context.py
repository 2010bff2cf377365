"""What every server step of the GPU check (`serve_checks`, `variant_servers`) runs with: the mode's
`Plan`, a `StepContext` that starts its servers (their logs in OUT/servers.log), OUT/results.jsonl and the
`sluice bench` JSON the steps leave, and the calls a step makes to its server: its model info, greedy
outputs of fixed prompts, and `sluice bench` run beside it as a user runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.benchmarks.gpu.step_profiles import ProfilePlan
from sluice.benchmarks.serving.server_process import ServerProcess
from sluice.client import Client, Completion, generate_request

RESULTS = "results.jsonl"
SERVERS_LOG = "servers.log"
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
    # fp8/async servers' `sluice bench` runs: (concurrency, requests). At 64, four rounds of 64 requests:
    # one round's throughput was its prompt burst's (run 5: TTFT p90 0.26-0.60 s of a 1.3-1.7 s run)
    variant_bench: tuple[tuple[int, int], ...]
    large_preset: str  # the large step's shape (the CPU mode runs it on tiny)
    large_bench: tuple[str, ...]
    profiles: ProfilePlan  # the fp8_large servers' step profiles (`step_profiles`)
    # The large step's: one prompt of its bench's length, its first forward step (the whole prompt at the
    # GPU's 8192-token budget); max_tokens keeps it streaming until the profile is written.
    large_profile: ProfilePlan
    # The async step's second server, Sluice's skinny linears; None: not run (the CPU mode: on the Triton
    # interpreter one server's requests took over two minutes, the tiny preset's 32k-row lm_head alone
    # hundreds of interpreted programs a step; tests/test_model_parity.py checks them on CPU instead)
    skinny_serve_args: tuple[str, ...] | None = ("--skinny-linears",)
    # fp8_large's server with the RMSNorms in the FP8 linears' one-row launches (`--fuse-norm-fp8`),
    # after the fp8-KV one; None: not run (the CPU mode: those launches need the Triton kernels, which its
    # servers do not run; tests/test_fp8_folded_inputs_model.py checks them on CPU instead)
    fp8_norm_serve_args: tuple[str, ...] | None = ("--fuse-norm-fp8",)
    # ... and one with SiLU-and-mul in down_proj's one-row launch too (`--fuse-silu-fp8`), after it; None:
    # not run (the CPU mode, as above; tests/test_fp8_folded_inputs_model.py)
    fp8_fold_serve_args: tuple[str, ...] | None = ("--fuse-norm-fp8", "--fuse-silu-fp8")
    # The async step's speculating servers (`variant_servers.SPEC_VARIANTS`: n-gram drafts under async
    # scheduling, then paused from 16 running requests), after its others; only with SPEC_ASYNC_ENV=1
    spec_servers: bool = False

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
        variant_bench=((1, 8), (64, 256)), large_preset="llama-3-8b",
        # One seed on both servers of the step (the baseline's is another, fresh one): the same prompts.
        large_bench=("--concurrency", "1", "--num-requests", "6", "--input-len", "4096",
                     "--output-len", "64", "--seed", "3"),
        profiles=ProfilePlan(batches=(1, 64), num_steps=12, prompt_len=128, max_tokens=1024, prefill_batch=64,
                             prefill_steps=8),
        large_profile=ProfilePlan(batches=(), num_steps=0, prompt_len=4096, max_tokens=4096, prefill_batch=1,
                                  prefill_steps=1),
    ),
    "cpu": Plan(
        preset="tiny", dtype="float32", extra_serve_args=("--kv-cache-memory", "256MiB"), sweep="1,16,64",
        num_requests=4, input_len=16, output_len=4, greedy_prompts=3, greedy_tokens=8, near_tie_nats=1e-3,
        variant_bench=((1, 2), (64, 4)), large_preset="tiny",
        large_bench=("--concurrency", "1", "--num-requests", "2", "--input-len", "24", "--output-len", "3",
                     "--seed", "3"),
        profiles=ProfilePlan(batches=(1, 4), num_steps=3, prompt_len=16, max_tokens=2048, prefill_batch=4,
                             prefill_steps=3),
        large_profile=ProfilePlan(batches=(), num_steps=0, prompt_len=24, max_tokens=2048, prefill_batch=1,
                                  prefill_steps=1),
        skinny_serve_args=None,
        fp8_norm_serve_args=None,
        fp8_fold_serve_args=None,
    ),
}  # fmt: skip


# The servers of options that a GPU run timed and left off by default (docs/GPU.md's table of changes, run 16:
# each lost): the async step's skinny linears and fp8_large's two with the FP8 linears' inputs folded in,
# ~90 s of a lease. They serve again with SLUICE_GPU_CHECK_OFF_OPTIONS=1 (after a change to their kernels).
OFF_OPTIONS_ENV = "SLUICE_GPU_CHECK_OFF_OPTIONS"
# The async step's two speculating servers and the first one's profiles (~60 s on a GPU): whether a
# speculating batch, which gives up the overlap (docs/ARCHITECTURE.md, "Async scheduling"), still pays on a
# GPU. Served with SPEC_ASYNC_ENV=1.
SPEC_ASYNC_ENV = "SLUICE_GPU_CHECK_SPEC_ASYNC"


def plan_for(mode: str, environ: Mapping[str, str] = os.environ) -> Plan:
    """The mode's plan as the steps run it: `PLANS[mode]` less the off-by-default options' servers, unless
    `OFF_OPTIONS_ENV` is 1 in `environ`, and with the async step's speculating servers where `SPEC_ASYNC_ENV`
    is 1."""
    plan = dataclasses.replace(PLANS[mode], spec_servers=environ.get(SPEC_ASYNC_ENV) == "1")
    if environ.get(OFF_OPTIONS_ENV) == "1":
        return plan
    off = {"skinny_serve_args": None, "fp8_norm_serve_args": None, "fp8_fold_serve_args": None}
    return dataclasses.replace(plan, **off)


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


def append_result(out: Path, record: dict[str, Any]) -> None:
    """One JSON line appended to OUT/results.jsonl."""
    with (out / RESULTS).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_runs(path: Path) -> list[dict[str, Any]]:
    """The runs of a `sluice bench --json` file; none if the file is missing."""
    if not path.is_file():
        return []
    return json.loads(path.read_text(encoding="utf-8")).get("runs", [])


def model_info(client: Client) -> dict[str, Any]:
    info = client.model_info(timeout=RPC_TIMEOUT_S)
    return {
        "model_name": info.model_name,
        "vocab_size": info.vocab_size,
        "max_model_len": info.max_model_len,
        "kv_capacity_tokens": info.kv_capacity_tokens,
        "num_kv_blocks": info.num_kv_blocks,
        "speculative_method": info.speculative_method,
        "max_num_batched_tokens": info.max_num_batched_tokens,
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


def bench_runs(target: str, args: Sequence[str]) -> tuple[int, list[dict[str, Any]]]:
    """`run_bench` into a file of its own: its exit status and its runs without their per-request
    timelines, for a step's record."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        rc = run_bench(target, args, path)
        runs = json.loads(path.read_text())["runs"] if path.is_file() else []
    return rc, [{key: value for key, value in run.items() if key != "requests"} for run in runs]
