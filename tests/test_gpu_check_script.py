"""The GPU check: scripts/gpu_check.sh run end to end in its CPU mode, and the pure parts of
scripts/gpu_check.py and sluice.benchmarks.gpu (comparisons, floors, the report) on known inputs.

The CPU mode runs the same steps as on a GPU (kernel tests, scripts/gpu_check.py, six real servers,
`sluice bench`) on the tiny preset in float32; it installs nothing: SLUICE_GPU_CHECK_PYTHON points the script
at this interpreter, whose environment already has Sluice and its dependencies.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import paged_batch  # noqa: F401  (first: runs the kernels in the interpreter without CUDA)
import pytest
import torch
from packaging.version import Version
from processes import process_running

from sluice.benchmarks.gpu import (
    borrowed_tokenizer,
    check_figures,
    check_report,
    fp8_figures,
    gpu_benchmarks,
    greedy_compare,
    kernel_test_files,
    serve_checks,
    step_context,
    variant_servers,
)
from sluice.benchmarks.gpu.structured_request import SCHEMA, _errors_by_hand, schema_errors
from sluice.benchmarks.gpu.variant_sections import ASYNC_LABELS
from sluice.engine.loading.presets import preset_arch
from sluice.engine.worker.attention import triton_backend
from sluice.engine.worker.attention.selector import FP8_KV_TRITON_NOTE
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.engine.worker.layers.activation import SiluAndMul
from sluice.engine.worker.layers.attention import Attention
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear import LinearBase
from sluice.engine.worker.layers.linear_method import SkinnyLinearMethod
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.kernels.paged_decode_attention import DEFAULT_PARTITION_SIZE, DecodeConfig

REPO = Path(__file__).parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
_SPEC = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_check)

OUT_FILES = {"report.md", "gpu_check.md", "results.jsonl", "steps.log", "servers.log", "bench_serve.json",
             "bench_large.json"}  # fmt: skip


@pytest.fixture(autouse=True)
def _no_off_options(monkeypatch):
    """The plans as run by default, whatever this shell set: the tests that want a knob set it."""
    monkeypatch.delenv(step_context.OFF_OPTIONS_ENV, raising=False)
    monkeypatch.delenv(step_context.SPEC_ASYNC_ENV, raising=False)


def run_script(out: Path, timeout: float, python: str = sys.executable, **env: str):
    environment = {
        **os.environ,
        "SLUICE_GPU_CHECK_DEVICE": "cpu",
        "SLUICE_GPU_CHECK_PYTHON": python,
        **env,
    }
    return subprocess.run(
        [str(SCRIPT), str(out)], cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout
    )


def statuses(out: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "status" in r}


def step_result(out: Path, step: str) -> dict:
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return next(r for r in records if r.get("step") == step and "status" not in r and "variant" not in r)


def variant_records(out: Path, step: str = "fp8") -> dict[str, dict]:
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {r["variant"]: r for r in records if r.get("step") == step and "variant" in r}


# ---- the whole script, CPU mode ---------------------------------------------------------------------


@pytest.mark.timeout(900)
def test_the_script_runs_every_step_on_cpu_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_script(out, timeout=840, **{step_context.SPEC_ASYNC_ENV: "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = {p.name for p in out.iterdir() if p.is_file()}
    assert files == OUT_FILES and len(files) <= 8
    assert {p.name for p in out.iterdir() if p.is_dir()} == {"profiles"}  # the large step's prompt profile

    steps = statuses(out)
    assert {name: steps[name]["status"] for name in steps} == {
        "install": "skipped",
        "kernel_tests": "passed",
        "gpu_check": "passed",
        "kernel_bench": "skipped",  # run only when named (test_the_kernel_bench_step_...)
        "serve_bench": "passed",
        "speculative": "passed",
        "structured": "passed",
        "tensor_parallel": "skipped",
        "fp8": "passed",
        "async": "passed",
        "large": "passed",  # on the tiny preset here
        "fp8_large": "skipped",  # run only when named (test_the_fp8_large_step_...)
    }
    assert steps["fp8_large"]["note"] == "not in SLUICE_GPU_CHECK_STEPS (runs only when named there)"
    assert step_result(out, "tensor_parallel")["skipped"] == "needs 2 GPUs, this machine has 0"

    (run,) = json.loads((out / "bench_large.json").read_text())["runs"]
    assert run["config"]["workload"]["input_len"] == 24 and run["metrics"]["num_completed"] == 2
    large = step_result(out, "large")
    assert large["model_info"]["model_name"] == "dummy-tiny"
    assert large["model_info"]["max_num_batched_tokens"] == 2048  # a CPU's default, the baseline's too
    (baseline,) = large["baseline_runs"]  # the same bench at the 2048-token step budget, in the record
    assert large["baseline_model_info"]["max_num_batched_tokens"] == 2048 and large["baseline_bench_rc"] == 0
    assert baseline["config"]["workload"] == run["config"]["workload"] and "requests" not in baseline
    assert baseline["metrics"]["num_completed"] == 2
    assert "--max-num-batched-tokens 2048" in (out / "servers.log").read_text()
    # One more prompt of the bench's length, its first step profiled: the whole prompt in that step.
    profile = large["prompt_profile"]
    assert profile["steps"] == 1 and profile["rows_per_step"] == [24], profile.get("error")
    assert profile["requests"]["batch"] == 1 and profile["requests"]["tokens_at_cancel"][0] >= 1
    runs = json.loads((out / "bench_serve.json").read_text())["runs"]
    assert [run["config"]["concurrency"] for run in runs] == [1, 16, 64]
    assert all(run["metrics"]["num_completed"] == run["metrics"]["num_requests"] == 4 for run in runs)

    reference = step_result(out, "serve_bench")
    assert [len(sample["tokens"]) for sample in reference["greedy"]] == [8, 8, 8]
    speculative = step_result(out, "speculative")
    assert speculative["comparison"]["mismatch"] == 0 and speculative["draft_tokens"] > 0
    assert speculative["model_info"]["speculative_method"] == "ngram"

    # fp8: two more servers, each set against serve_bench's float32 one.
    assert step_result(out, "fp8")["variants"] == ["fp8", "fp8_kv"]
    fp8 = variant_records(out)
    blocks = reference["model_info"]["num_kv_blocks"]
    assert fp8["fp8"]["model_info"]["num_kv_blocks"] == blocks  # the same 256 MiB of float32 cache
    assert fp8["fp8_kv"]["model_info"]["num_kv_blocks"] == 4 * blocks  # a byte a value, not 4
    assert "torch.float8_e4m3fn" in fp8["fp8_kv"]["server_notes"][0]
    for record in fp8.values():
        assert record["ok"] and record["bench_rc"] == [0, 0]
        assert [run["config"]["concurrency"] for run in record["runs"]] == [1, 64]
        assert [run["metrics"]["num_completed"] for run in record["runs"]] == [2, 4]
        assert not any(run["cache_hits_unexpected"] for run in record["runs"])  # prompts of their own
        assert [len(sample["tokens"]) for sample in record["greedy"]] == [8, 8, 8]
        comparison, agreement = record["comparison"], record["agreement"]
        assert comparison["equal"] + comparison["near tie"] + comparison["mismatch"] == 3
        assert agreement["equal"] == comparison["equal"] and agreement["tokens"] == 24

    # async: --async-scheduling gives the synchronous server's greedy tokens, and completes its bench runs,
    # as do its speculating servers (SLUICE_GPU_CHECK_SPEC_ASYNC=1), drafts verified (the skinny linears'
    # server runs on a GPU only: Plan.skinny_serve_args).
    assert step_result(out, "async")["variants"] == ["async", *variant_servers.SPEC_VARIANTS]
    for name, record in variant_records(out, "async").items():
        assert record["comparison"]["equal"] == 3 and record["bench_rc"] == [0, 0], name
        assert [run["metrics"]["num_completed"] for run in record["runs"]] == [2, 4], name
        assert "--async-scheduling" in record["serve_args"], name
        assert (sum(s["draft_tokens"] for s in record["greedy"]) > 0) == (name != "async"), name
        # the first speculating server's steps profiled, every profile written
        profiles = record.get("profiles", {})
        profiled = name in variant_servers.PROFILED_ASYNC
        assert sorted(profiles) == (["b1", "b4", "prefill4"] if profiled else []), name
        assert not any("error" in summary for summary in profiles.values()), name

    structured = step_result(out, "structured")
    assert structured["vocab_size"] == 49152  # tiny's 32000 widened to SmolLM2's tokenizer
    for answer in structured["answers"]:
        jsonschema.validate(json.loads(answer["text"]), SCHEMA)
    assert structured["answers"][1]["cached_tokens"] > 0  # the same chat prompt, served from the cache
    # Served with ngram speculation: the greedy answer unchanged, drafts (the keys, forced) verified.
    for answer in structured["speculating"]:
        jsonschema.validate(json.loads(answer["text"]), SCHEMA)
    assert structured["speculating"][0]["text"] == structured["answers"][0]["text"]
    assert structured["speculating_greedy_same"]
    assert all(answer["draft_tokens"] > 0 for answer in structured["speculating"])
    # Timed: the same greedy answer from each server (with and without async scheduling), each answer's
    # TPOT from the server's timings, its drafts verified when speculating.
    timed = structured["timed"]
    assert set(timed) == {"plain", "speculating", "speculating_sync"}
    for name, runs in timed.items():
        assert [a["text"] for a in runs["answers"]] == [structured["answers"][0]["text"]] * 5, name
        assert all(a["tpot_ms"] > 0 and a["num_tokens"] > 1 for a in runs["answers"]), name
        assert runs["tpot_ms_median"] == sorted(a["tpot_ms"] for a in runs["answers"])[2], name
        assert all((a["draft_tokens"] > 0) == (name != "plain") for a in runs["answers"]), name

    parity = (out / "gpu_check.md").read_text()
    assert "## Parity with transformers (Triton kernels)\n\nPASS" in parity
    assert "## Decode step" in parity and "skipped: needs CUDA (this run is on the CPU)" in parity
    report = (out / "report.md").read_text()
    assert report.startswith("# Sluice GPU check: CPU: PASS")
    assert "**TPOT of the greedy JSON answer** (median of 5 answers a server" in report
    assert "`--speculative ngram`, async scheduling " in report and "not timed" not in report
    assert (
        "| serve_bench | sluice serve + greedy reference + sluice bench --sweep 1,16,64 | PASSED |" in report
    )
    assert "**Tensor parallelism (issue 35):** needs 2 GPUs, this machine has 0" in report
    assert "## FP8 (issue 34): bf16 vs fp8 weights vs fp8 weights + fp8 KV" in report
    assert f"| {4 * blocks} (4.00x) | 6/6 |" in report  # the fp8-KV server's KV blocks, 4x float32's
    assert "| fp8 KV: KV blocks / float32's | 4.00 | >= 2.0 | met |" in report
    assert "CPU mode: FP8 is emulated (a correctness path, not a speed path)" in report
    assert "## Async scheduling (issue 33): --async-scheduling vs synchronous" in report
    assert "**Where the tiny TTFT goes: one 24-token prompt's first step** (the engine core's" in report
    assert "| --async-scheduling | " in report and "| 6/6 | 3/3 equal; 24/24 tokens" in report
    assert "--skinny-linears |" not in report  # never planned here: no row
    ngram = ASYNC_LABELS["async_ngram"]
    assert f"**Greedy, {ngram} vs synchronous** (must be equal, near ties aside): 3 equal" in report
    assert "**Where a step's time goes** (the engine core's torch.profiler over 3 decode steps" in report
    assert f"**{ngram}, 1 sequence a step**: " in report and f"**{ngram}, 4 sequences a step**: " in report
    assert "the skinny linears' server does not run (their kernels interpreted" in report
    assert proc.stdout.rstrip().endswith(f"report: {out}/report.md") and "PASS in" in proc.stdout


def test_the_kernel_bench_step_writes_its_tables_when_named(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_script(out, timeout=300, SLUICE_GPU_CHECK_STEPS="kernel_bench")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = statuses(out)
    assert steps["kernel_bench"]["status"] == "passed" and steps["kernel_bench"]["limit_s"] == 120 + 150
    bench = (out / "kernel_bench.md").read_text()
    assert bench.startswith("# FP8 linears at decode batch sizes (cpu, Triton interpreter: no speed figures)")
    assert "| tiny one | 32 x 256 | 1 |" in bench and "## Per layer (the four linears summed)" in bench
    assert "fold" in bench.split("## Per layer")[1]  # fp8_kv_paths' table, appended
    assert "## Per decoder layer (two norms and one silu)" in bench  # fused_quant_bench's, appended
    report = (out / "report.md").read_text()
    assert "| kernel_bench | kernels one at a time: FP8 linears at decode batch sizes vs bf16" in report


@pytest.mark.timeout(600)
def test_the_fp8_large_step_serves_bf16_then_fp8s_servers_on_cpu(tmp_path: Path) -> None:
    # Named alone: four servers of the large step's shape (tiny here), the first its own reference.
    out = tmp_path / "out"
    proc = run_script(out, timeout=540, SLUICE_GPU_CHECK_STEPS="fp8_large")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = statuses(out)
    assert steps["fp8_large"]["status"] == "passed" and steps["fp8_large"]["limit_s"] <= 330
    assert steps["large"] == {**steps["large"], "status": "skipped", "note": "not in SLUICE_GPU_CHECK_STEPS"}
    result = step_result(out, "fp8_large")
    assert result["variants"] == ["bf16", "fp8", "fp8_kv", "fp8_block"] and result["preset"] == "tiny"
    assert len(result["ready_s"]) == 4

    servers = variant_records(out, "fp8_large")
    assert list(servers) == ["bf16", "fp8", "fp8_kv", "fp8_block"]  # written in order, as each finished
    reference = servers["bf16"]
    assert "comparison" not in reference and len(reference["prompts"]) == 3
    assert reference["serve_args"][:4] == ["--preset", "tiny", "--dtype", "float32"]
    assert servers["fp8"]["serve_args"][-3:] == ["--async-scheduling", "--quantization", "fp8"]
    assert reference["serve_args"][-1] == "--async-scheduling"  # as served on CUDA, on all three
    assert servers["fp8_kv"]["serve_args"][-4:] == ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    assert servers["fp8_block"]["serve_args"][-4:] == ["--quantization", "fp8", "--fp8-weight-block", "128"]
    blocks = reference["model_info"]["num_kv_blocks"]
    assert servers["fp8"]["model_info"]["num_kv_blocks"] == blocks  # the same 256 MiB of float32 cache
    assert servers["fp8_kv"]["model_info"]["num_kv_blocks"] == 4 * blocks  # a byte a value, not 4
    for name, record in servers.items():
        assert record["ok"] and record["bench_rc"] == [0, 0]
        # The same seeds on every server: the same prompts, so the three are compared on the same work.
        assert [(r["config"]["concurrency"], r["config"]["seed"]) for r in record["runs"]] == [
            (1, 1),
            (64, 2),
        ]
        assert [run["metrics"]["num_completed"] for run in record["runs"]] == [2, 4]
        assert [len(sample["tokens"]) for sample in record["greedy"]] == [8, 8, 8]
        # Its step profiles at batch 1 and 4 (the CPU plan's): every profiled step had the whole batch,
        # the requests cancelled once the profile was written; CPU times, since no device ran.
        assert "--profile-dir" in record["serve_args"]
        for batch in (1, 4):
            profile = record["profiles"][f"b{batch}"]
            assert profile["steps"] == 3 and profile["rows_per_step"] == [batch] * 3, profile
            assert profile["measured"] == "cpu" and profile["top"][0]["self_cpu_us"] > 0
            assert all(tokens >= 1 for tokens in profile["requests"]["tokens_at_cancel"])
            assert len(list((out / "profiles" / f"fp8_large-{name}" / f"b{batch}").glob("profile-*"))) == 3
        # A burst of 4 prompts of 16 tokens, profiled from before they were sent: the first forward is
        # whole prompts only (however many had arrived), none decoded yet.
        burst = record["profiles"]["prefill4"]
        assert burst["steps"] == 3 and burst["rows_per_step"][0] in (16, 32, 48, 64), burst
    for name in ("fp8", "fp8_kv", "fp8_block"):
        comparison, agreement = servers[name]["comparison"], servers[name]["agreement"]
        assert comparison["equal"] + comparison["near tie"] + comparison["mismatch"] == 3
        assert agreement["equal"] == comparison["equal"] and agreement["tokens"] == 24

    report = (out / "report.md").read_text()
    assert report.startswith("# Sluice GPU check: CPU: PASS")
    section = report.split("## FP8 on the llama-3-8b shape (issue 34)\n\n")[1].split("\n## ")[0]
    assert section.startswith("The tiny preset (float32) on 4 servers of this step, one after another")
    for line in (
        "| server | TPOT p50 ms, c=1 | TPOT p50 ms, c=64 | out tok/s, c=64 | KV blocks | requests done "
        "| greedy vs float32 |",
        f"| {blocks} | 6/6 | the reference |",
        f"| {4 * blocks} (4.00x) | 6/6 | ",
        "| fp8 weights: batch-1 TPOT p50 / float32's (here tiny, the goal is set on llama-3-8b) | ",
        "| fp8 KV: KV blocks / float32's | 4.00 | >= 2.0 | met |",
        "| fp8 KV: KV blocks / fp8 weights' (same weights) | 4.00 |  |  |",
        "(the CPU mode runs this step on the tiny preset). The weight bytes a batch-1 step reads, fp8 over "
        "bf16 (lm_head stays bf16), the floor of that TPOT ratio: 0.61 on llama-3.2-1b, 0.53 on llama-3-8b.",
        "CPU mode: FP8 is emulated (a correctness path, not a speed path)",
        "**fp8 weights + fp8 KV vs float32, greedy** (need not be equal: another rounding): ",
    ):
        assert line in section, line
    assert "| float32 (this step's) | " in section and "| fp8 weights + fp8 KV | " in section
    assert "| fp8 weights, 128 x 128 blocks | " in section
    assert "**fp8 weights, 128 x 128 blocks vs float32, greedy** (need not be equal" in section
    assert (
        "**Where a step's device time goes** (the engine core's torch.profiler over 3 decode steps" in section
    )
    for server in ("bf16", "fp8", "fp8_kv", "fp8_block"):
        for batch in (1, 4):
            sequences = "1 sequence" if batch == 1 else f"{batch} sequences"
            assert f"**{server}, {sequences} a step**: 3 steps of {batch} rows, CPU only" in section
    assert "| operator | us / step | share | calls / step |" in section
    assert "**fp8_kv, a burst of 4 prompts from its first step**: tokens a step [" in section
    assert "Not measured: the fp8 step SKIPPED (not in SLUICE_GPU_CHECK_STEPS)." in report


def test_a_hung_step_is_killed_at_its_limit_and_fails_the_check(tmp_path: Path) -> None:
    # A python that hangs when asked to run pytest (the kernel-test step; -P: the repository's kernels/
    # must not hide Hugging Face's `kernels`, which transformers imports) after printing a line, and is
    # itself otherwise.
    pid_file = tmp_path / "hung.pid"
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/bash\n"
        f'if [[ "$1 $2 $3" == "-P -m pytest" ]]; then echo $$ > {pid_file}; echo "..... [ 48%]"; '
        "exec sleep 300; fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "out"
    env = {"SLUICE_GPU_CHECK_STEPS": "kernel_tests", "SLUICE_GPU_CHECK_STEP_LIMIT_S": "3"}
    proc = run_script(out, timeout=300, python=str(python), **env)
    assert proc.returncode == 1
    steps = statuses(out)
    assert steps["kernel_tests"]["status"] == "timed out" and steps["kernel_tests"]["limit_s"] == 3
    assert (steps["gpu_check"]["status"], steps["gpu_check"]["note"]) == (
        "skipped",
        "not in SLUICE_GPU_CHECK_STEPS",
    )
    assert not process_running(int(pid_file.read_text()))  # the hung process went with its step
    # The file cut at the limit is named with what it had written (its output was deleted unread).
    log = (out / "steps.log").read_text()
    cut = "kernel tests: tests/test_kernels_store_kv.py cut at the step's limit; its output so far:"
    assert f"{cut}\n..... [ 48%]" in log
    report = (out / "report.md").read_text()
    assert report.startswith("# Sluice GPU check: CPU: FAIL")
    assert "| kernel_tests |" in report and "| TIMED OUT | " in report


def test_a_budget_too_small_fails_the_required_steps_and_skips_the_optional_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_script(out, timeout=300, SLUICE_GPU_CHECK_BUDGET_S="40")
    assert proc.returncode == 1
    steps = statuses(out)
    for name in ("kernel_tests", "gpu_check", "serve_bench", "speculative", "structured", "tensor_parallel"):
        assert steps[name]["status"] == "out of time", name
    assert steps["fp8"]["status"] == steps["async"]["status"] == steps["large"]["status"] == "skipped"
    assert steps["fp8_large"]["note"] == "not in SLUICE_GPU_CHECK_STEPS (runs only when named there)"
    assert (out / "report.md").read_text().startswith("# Sluice GPU check: CPU: FAIL")


def test_the_on_request_steps_run_last_and_are_skipped_for_time_without_failing(tmp_path: Path) -> None:
    """fp8_large, then kernel_bench, after every other step: a call naming both gives kernel_bench what
    fp8_large leaves, and a budget too small for either skips them without failing the check."""
    out = tmp_path / "out"
    proc = run_script(
        out, timeout=300, SLUICE_GPU_CHECK_STEPS="kernel_bench fp8_large", SLUICE_GPU_CHECK_BUDGET_S="40"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    order = [r["step"] for r in records if "status" in r]
    assert order[-2:] == ["fp8_large", "kernel_bench"] and len(order) == len(check_report.STEPS)
    assert order == list(check_report.STEPS)  # the report's table in the script's order
    steps = statuses(out)
    for name in ("fp8_large", "kernel_bench"):
        assert steps[name]["status"] == "skipped" and "s left of the 40s budget, needs" in steps[name]["note"]


def test_the_script_refuses_a_missing_out_dir_an_unknown_device_and_an_unknown_step(tmp_path: Path) -> None:
    proc = subprocess.run([str(SCRIPT)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == "usage: scripts/gpu_check.sh OUT_DIR\n"
    env = {**os.environ, "SLUICE_GPU_CHECK_DEVICE": "tpu"}
    proc = subprocess.run(
        [str(SCRIPT), str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr == "SLUICE_GPU_CHECK_DEVICE: must be cuda or cpu, got 'tpu'\n"
    env = {**os.environ, "SLUICE_GPU_CHECK_STEPS": "serve_bench,parity"}
    proc = subprocess.run(
        [str(SCRIPT), str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr == (
        "SLUICE_GPU_CHECK_STEPS: unknown step 'parity'; "
        "steps: kernel_tests gpu_check serve_bench speculative structured tensor_parallel fp8 async large "
        "fp8_large kernel_bench\n"
    )
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_the_wheel_list_pins_one_version_of_each_and_stubs_fit_its_grpc_and_protobuf() -> None:
    lines = (REPO / "scripts" / "gpu_wheels.txt").read_text().splitlines()
    pins = dict(
        line.removeprefix("build: ").split("==") for line in lines if line and not line.startswith("#")
    )
    assert len(pins) == len([line for line in lines if line and not line.startswith("#")])  # one of each
    needed = {"msgspec", "pyzmq", "xgrammar", "apache-tvm-ffi", "pydantic", "gguf", "grpcio-health-checking"}
    needed |= {"grpcio-reflection", "pytest-asyncio", "setuptools", "opentelemetry-sdk", "grpcio", "protobuf"}
    assert needed <= set(pins)
    grpc_stub = (REPO / "clients/python/sluice/v1/sluice_pb2_grpc.py").read_text()
    pb_stub = (REPO / "clients/python/sluice/v1/sluice_pb2.py").read_text()
    grpc_needed = grpc_stub.split("GRPC_GENERATED_VERSION = '")[1].split("'")[0]
    pb_needed = pb_stub.split("# Protobuf Python Version: ")[1].split()[0]
    assert Version(pins["grpcio"]) >= Version(grpc_needed) and Version(pins["protobuf"]) >= Version(pb_needed)


def test_every_runtime_dependency_is_on_the_gpu_image_or_in_the_wheel_list() -> None:
    """pyproject.toml's dependencies: each is one the GPU image has (docs/GPU.md, /work/shared/GPU_NOTES.md)
    or one `make gpu-wheels` brings; a new dependency missing from both fails here, not on the GPU."""
    lines = (REPO / "scripts" / "gpu_wheels.txt").read_text().splitlines()
    pinned = {line.split("==")[0] for line in lines if line and not line.startswith(("#", "build: "))}
    image = {"torch", "numpy", "safetensors", "tokenizers", "jinja2", "triton", "ninja", "uvloop"}
    image |= {"prometheus-client"}
    with open(REPO / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    names = {re.split(r"[<>=!~;\[ ]", dependency, maxsplit=1)[0].lower() for dependency in dependencies}
    assert names - image - pinned == set()


# ---- scripts/gpu_check.py -------------------------------------------------------------------------


def test_markdown_table():
    table = gpu_check.markdown_table(["batch", "ms"], [[1, 12.3456], [128, 0.5]])
    assert table == "| batch | ms |\n| --- | --- |\n| 1 | 12.3 |\n| 128 | 0.5 |"


def test_markdown_table_rejects_a_short_row():
    with pytest.raises(ValueError, match="^rows: a row has 1 cells, expected 2$"):
        gpu_check.markdown_table(["a", "b"], [[1]])


def test_floor_and_bytes():
    # 2.47 GB of bf16 weights at 3 TB/s: 0.823 ms per batch-1 step at best.
    assert gpu_benchmarks.floor_step_time_s(2_470_000_000, 3e12) == pytest.approx(8.2333e-4, rel=1e-4)
    with pytest.raises(ValueError, match="^bandwidth_bytes_per_s: must be > 0"):
        gpu_benchmarks.floor_step_time_s(1, 0.0)
    # 32 sequences x 4096 positions x 8 kv heads x 64 dims x 2 bytes, for K and for V.
    assert gpu_benchmarks.kv_read_bytes(32, 4096, 8, 64, 2) == 268_435_456


def test_decode_step_inputs_are_disjoint_pure_decode_rows():
    inputs = gpu_benchmarks.decode_step_inputs(3, 40, 16, torch.device("cpu"))
    md = inputs.metadata
    assert md.is_pure_decode and md.seq_lens.tolist() == [40, 40, 40]
    assert md.block_tables.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert md.slot_mapping.tolist() == [2 * 16 + 7, 5 * 16 + 7, 8 * 16 + 7]
    assert inputs.positions.tolist() == [39, 39, 39]


ATTENTION_ROWS = [[4096, 32, 100.0, 2600.0, 0.65], [32768, 8, 200.0, 2800.0, 0.68]]
PREFILL_ROWS = [[2048, 1.0, 300.0, 0.9, 330.0, 0.9], [8192, 10.0, 400.0, 7.0, 560.0, 0.7]]


def test_goal_rows_state_each_goal_and_whether_it_was_met():
    rows = gpu_benchmarks.goal_rows(1.2e-3, 1e-3, 1.4, ATTENTION_ROWS, PREFILL_ROWS)
    assert [(row[0], row[2]) for row in rows] == [
        ("batch-1 graph step / floor <= 1.5", "met"),
        ("CUDA graphs vs eager at batch 1 >= 1.5x", "NOT met"),
        ("decode attention 4k x 32 >= 60% of copy bw", "met"),
        ("decode attention 32k x 8 >= 70% of copy bw", "NOT met"),
        ("prefill attention 2k >= 0.8x torch SDPA", "met"),
        ("prefill attention 8k >= 0.8x torch SDPA", "NOT met"),
    ]
    assert rows[0][1] == pytest.approx(1.2) and rows[3][1] == 0.68


def test_parity_check_runs_the_triton_model_against_transformers():
    # The GPU check's own parity path, on CPU in float32 with the kernels interpreted: it must pass
    # with float32-sized differences, so a regression in the script or the fused model path fails here.
    ok, rows = gpu_check.check_parity(torch.device("cpu"), torch.float32, steps=4)
    assert ok
    assert rows[0][0] == "prefill last-token logits, max abs diff" and rows[0][1] < 1e-4
    assert rows[1] == ["greedy tokens equal", "4/4"]


def test_prefill_inputs_and_causal_flops():
    md = gpu_benchmarks.prefill_step_inputs(40, 16, torch.device("cpu")).metadata
    assert md.query_start_loc.tolist() == [0, 40] and md.seq_lens.tolist() == [40]
    assert md.block_tables.tolist() == [[0, 1, 2]] and md.slot_mapping.tolist() == list(range(40))
    # 1 head, dim 1, 2 tokens: QK^T and PV each cover 3 visible pairs -> 2 * 2 * 3 flops.
    assert gpu_benchmarks.causal_attention_flops(2, 1, 1) == 12


def test_report_keeps_every_section_and_records_failures(tmp_path):
    out = tmp_path / "perf" / "gpu_check.md"
    report = gpu_check.Report(out, "# GPU check: test")
    report.section("first", lambda: "| a |")
    assert out.read_text() == "# GPU check: test\n\n## first\n\n| a |\n" and report.ok

    def failing_check() -> str:
        raise gpu_check.CheckFailed("2/8 tokens")

    def broken() -> str:
        raise RuntimeError("CUDA error: out of memory")

    report.section("parity", failing_check)
    report.section("bench", broken)
    report.section("after", lambda: "still measured")
    text = out.read_text()
    assert not report.ok
    assert "## parity\n\n**FAIL**\n\n2/8 tokens" in text
    assert "## bench\n\n**ERROR**" in text and "RuntimeError: CUDA error: out of memory" in text
    assert text.endswith("## after\n\nstill measured\n")


def _tiny_triton_model() -> tuple[torch.nn.Module, KernelConfig]:
    """The tiny preset with the Triton kernels on CPU (interpreted), and its default kernels."""
    cpu = torch.device("cpu")
    model = gpu_benchmarks.triton_model(preset_arch("tiny"), torch.float32, cpu)
    return model, KernelConfig.for_model(cpu, torch.float32, TritonAttentionBackend())


def test_the_fusion_section_switches_every_attention_layer():
    model, kernels = _tiny_triton_model()
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    separate = dataclasses.replace(kernels, fuse_rotary_store=False)
    assert gpu_benchmarks.select_attention(model, separate) == len(layers) > 0
    assert not any(layer.fuse_rotary_store for layer in layers)
    gpu_benchmarks.select_attention(model, kernels)
    assert all(layer.fuse_rotary_store for layer in layers)


def test_the_pdl_section_switches_every_float_linear_to_the_skinny_launch_and_back():
    model, kernels = _tiny_triton_model()
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    skinny = dataclasses.replace(kernels, skinny_linears=True)
    activations = [m for m in model.modules() if isinstance(m, SiluAndMul)]
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert gpu_benchmarks.select_float_linears(model, skinny) == len(linears) > 0
    assert all(isinstance(linear.method, SkinnyLinearMethod) for linear in linears)
    assert activations and norms and all(op.fuses_into_linear for op in activations + norms)
    gpu_benchmarks.select_float_linears(model, dataclasses.replace(skinny, fuse_silu_skinny=False))
    assert not any(op.fuses_into_linear for op in activations) and all(n.fuses_into_linear for n in norms)
    gpu_benchmarks.select_float_linears(model, dataclasses.replace(skinny, fuse_norm_skinny=False))
    assert all(op.fuses_into_linear for op in activations) and not any(n.fuses_into_linear for n in norms)
    gpu_benchmarks.select_float_linears(model, kernels)
    assert not any(isinstance(linear.method, SkinnyLinearMethod) for linear in linears)


def test_each_graph_of_the_partitions_section_is_timed_first_with_the_default_attention():
    """Its rows' speeds are against the first row of the same graph size, so that row must be the default
    tile and partition; the goal's graph (BENCH_CONTEXT) and the served one both try 32-position slices."""
    firsts = {}
    for graph, config, partition in gpu_benchmarks.GRAPH_STEP_PARTITIONS:
        firsts.setdefault(graph, (config, partition))
    assert firsts == {
        gpu_benchmarks.BENCH_CONTEXT: (None, DEFAULT_PARTITION_SIZE),
        gpu_benchmarks.SERVED_GRAPH_CONTEXT: (None, DEFAULT_PARTITION_SIZE),
    }
    for graph in firsts:
        assert (graph, DecodeConfig(32, 4, 2), 32) in gpu_benchmarks.GRAPH_STEP_PARTITIONS


def test_the_partitions_section_gives_each_rows_tile_and_partition_to_every_decode_launch(monkeypatch):
    """bench_graph_step_partitions on the tiny preset (a short context, so interpreted kernels stay quick):
    each row's backend hands its partition size and tile to every layer's decode launch (the graph's split
    count shows only on CUDA: the runner runs eagerly on the CPU); the logits stay the first row's within
    the section's bound, and the default backend is put back."""
    launches = []
    launch = triton_backend.paged_decode_attention

    def spy(*args, **kwargs):
        launches.append((kwargs["partition_size"], kwargs["config"]))
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_decode_attention", spy)
    selected = []
    select = gpu_benchmarks.select_attention
    monkeypatch.setattr(
        gpu_benchmarks,
        "select_attention",
        lambda model, kernels: selected.append(kernels.attention_backend) or select(model, kernels),
    )
    short = DecodeConfig(16, 4, 2)
    fused = DecodeConfig(16, 4, 2, fused_reduce=True)
    partitions = (
        (64, None, DEFAULT_PARTITION_SIZE),
        (256, None, DEFAULT_PARTITION_SIZE),
        (256, short, 16),
        (256, fused, 16),
    )
    times = iter([0.004, 0.004, 0.002, 0.001])
    cpu = torch.device("cpu")
    rows = gpu_benchmarks.bench_graph_step_partitions(
        cpu, preset="tiny", context=48, partitions=partitions, time_s=lambda fn: (fn(), next(times))[1]
    )
    layers = preset_arch("tiny").num_hidden_layers
    # A checked run and a timed one per row, each through every layer.
    assert launches == (
        [(DEFAULT_PARTITION_SIZE, None)] * 4 * layers
        + [(16, short)] * 2 * layers
        + [(16, fused)] * 2 * layers
    )
    default = f"{DEFAULT_PARTITION_SIZE} (default)"
    assert DEFAULT_PARTITION_SIZE >= 64  # so the 64 graph is one split: cdiv(64, the partition)
    assert [row[:4] for row in rows] == [
        [64, "128 (default)", default, 1],
        [256, "128 (default)", default, -(-256 // DEFAULT_PARTITION_SIZE)],
        [256, "16", "16", 16],  # pick_num_splits: 256 positions in partitions of 16 (2 KV heads, 132 SMs)
        [256, "16, fused reduce", "16", 16],
    ]
    assert [row[4:6] for row in rows] == [[4.0, 1.0], [4.0, 1.0], [2.0, 2.0], [1.0, 4.0]]  # vs its first row
    assert rows[0][6] == rows[1][6] == 0 and rows[2][6] <= gpu_benchmarks.GRAPH_MAX_REL_DIFF
    assert rows[3][6] == rows[2][6]  # the same merge, launched from the split kernel
    last = selected[-1]  # the model's layers are left on the default backend
    assert (last.decode_partition_size, last.decode_config) == (DEFAULT_PARTITION_SIZE, None)
    assert len(selected) == len(partitions) + 1


def test_sections_are_in_report_order_and_cuda_only_ones_skip_on_cpu():
    check = gpu_check.GpuCheck(torch.device("cpu"), skip_tests=True, skip_e2e=True)
    sections = check.sections()
    assert [key for key, _, _ in sections] == [
        "tests", "parity", "tensor_parallel", "ceilings", "decode", "fusion", "pdl", "partitions",
        "step_kernels", "attention", "prefill", "mixed", "split_prefill", "goals", "kv_fp8",
        "attention_sweep", "end_to_end",
    ]  # fmt: skip
    assert sections[0][2]().startswith("skipped")
    assert all(body() == gpu_check.CUDA_ONLY for key, _, body in sections[2:])


def test_print_kernel_tests_names_existing_files_with_their_pytest_arguments(capsys):
    assert gpu_check.main(["--print-kernel-tests"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [entry.line() for entry in gpu_check.KERNEL_TESTS]
    assert all((REPO / line.split("\t")[0]).is_file() for line in lines)
    # The files no GPU has run yet, then the longest, started together (eight at once on a GPU), the model
    # parity file with its triton backend only; each file once.
    assert lines[:5] == [
        "tests/test_decode_fused_reduce.py",
        "tests/test_async_launch_no_wait.py",
        "tests/test_triton_fp8_kv.py",
        "tests/test_kernels_attention.py",
        "tests/test_model_parity.py\t-k\ttriton",
    ]
    assert len({line.split("\t")[0] for line in lines}) == len(lines) == 19
    assert gpu_check.main(["--print-kernel-tests", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines() == ["tests/test_kernels_store_kv.py"]


def test_the_kernel_tests_knob_keeps_the_files_it_names_in_list_order(capsys):
    only = "test_model_parity.py tests/test_kernels_store_kv.py"
    for device in ("cuda", "cpu"):
        assert gpu_check.main(["--print-kernel-tests", "--device", device, "--kernel-tests", only]) == 0
        assert capsys.readouterr().out.splitlines() == [
            "tests/test_model_parity.py\t-k\ttriton",
            "tests/test_kernels_store_kv.py",
        ]
    for bad in ("test_nope.py", "other/test_model_parity.py", " "):
        with pytest.raises(ValueError, match="^SLUICE_GPU_CHECK_KERNEL_TESTS: "):
            kernel_test_files.select_kernel_tests(bad)
    assert gpu_check.main(["--print-kernel-tests", "--kernel-tests", "test_nope.py"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(
        "gpu_check: SLUICE_GPU_CHECK_KERNEL_TESTS: 'test_nope.py' is not a kernel test file"
    )
    assert "test_triton_fp8_kv.py" in error


def test_the_parity_files_keyword_selects_its_triton_backend_only():
    # The torch, cpu and cpu-layers backends (and the runner tests) run on the CPU device with the C++ CPU
    # kernels, a JIT build of minutes on the GPU machine: the GPU's kernel_tests step leaves them out.
    (entry,) = [e for e in gpu_check.KERNEL_TESTS if e.path == "tests/test_model_parity.py"]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        *entry.pytest_args(),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = [line for line in proc.stdout.splitlines() if line.startswith("tests/test_model_parity.py::")]
    parametrized = [line for line in collected if line.endswith("-triton]")]
    assert len(parametrized) == 3 * 6  # three tests over six checkpoints
    skinny = [line for line in collected if "::test_triton_skinny_linears_match_transformers[" in line]
    assert len(skinny) == 2 and len(collected) == len(parametrized) + len(skinny)  # the skinny linears


def test_the_kernel_tests_step_runs_the_files_the_knob_names(tmp_path: Path) -> None:
    out = tmp_path / "out"
    steps = {"SLUICE_GPU_CHECK_STEPS": "kernel_tests"}
    proc = run_script(out, timeout=600, SLUICE_GPU_CHECK_KERNEL_TESTS="test_kernels_store_kv.py", **steps)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert statuses(out)["kernel_tests"]["status"] == "passed"
    assert "kernel tests: tests/test_kernels_store_kv.py exit 0" in (out / "steps.log").read_text()
    # Two files at once (as on a GPU machine): each file's output whole, then its line.
    files = "test_kernels_store_kv.py test_kernels_fp8_quant.py"
    proc = run_script(
        out, timeout=600, SLUICE_GPU_CHECK_KERNEL_TESTS=files, SLUICE_GPU_CHECK_KERNEL_TEST_JOBS="2", **steps
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "steps.log").read_text()
    for name in files.split():
        summary = re.search(rf"\n(\d+) passed[^\n]*\nkernel tests: tests/{name} exit 0\n", log)
        assert summary and int(summary.group(1)) > 0, log[-3000:]
    proc = run_script(out, timeout=600, SLUICE_GPU_CHECK_KERNEL_TESTS="test_nope.py", **steps)
    assert proc.returncode == 1 and statuses(out)["kernel_tests"]["status"] == "failed"
    assert (
        "SLUICE_GPU_CHECK_KERNEL_TESTS: 'test_nope.py' is not a kernel test file"
        in (out / "steps.log").read_text()
    )


def test_measured_sections_leave_figures_the_report_reads(monkeypatch):
    # The CUDA sections with their benchmarks replaced by known numbers: the figures they record are
    # what check_figures turns into rows (the shapes the two must agree on, checked without a GPU).
    decode_rows = [[1, 5.0, 1.0, 5.0, 0.0], [64, 9.0, 3.0, 3.0, 0.0], ["graph pool MiB", 12.0, "", "", ""]]
    monkeypatch.setattr(gpu_check, "copy_bandwidth_bytes_per_s", lambda device: 3e12)
    monkeypatch.setattr(gpu_check, "matmul_flops_per_s", lambda device: 8e14)
    monkeypatch.setattr(gpu_check, "bench_decode", lambda device: (decode_rows, 1e-3, 1.5e9))
    monkeypatch.setattr(gpu_check, "bench_attention", lambda device, bandwidth: ATTENTION_ROWS)
    monkeypatch.setattr(gpu_check, "bench_prefill_attention", lambda device: PREFILL_ROWS)
    check = gpu_check.GpuCheck(torch.device("cpu"), skip_tests=True, skip_e2e=True)
    for body in (check.ceilings, check.decode, check.attention, check.prefill, check.goals):
        body()
    figures = check.figures
    assert figures["decode"]["floor_s"] == pytest.approx(5e-4)
    assert figures["decode"]["graph_step_s"] == {"1": 1e-3, "64": 3e-3}
    rows = check_figures.kernel_rows(figures)
    assert [row[0] for row in rows] == [
        "prefill attention, 2k causal, TFLOP/s",
        "prefill attention, 8k causal, TFLOP/s",
        "paged decode attention, 4k x 32, GB/s",
        "paged decode attention, 32k x 8, GB/s",
        "1b batch-1 decode step (CUDA graph), ms",
    ]
    assert rows[-1] == [
        "1b batch-1 decode step (CUDA graph), ms",
        "1.00",
        "floor 0.50",
        "2.00",
        "<= 1.5",
        "NOT met",
    ]
    assert rows[2][1:] == ["2600", "copy 3000", "0.65", ">= 0.60", "met"]
    serve_runs = [
        {"config": {"concurrency": 1}, "metrics": {"tpot": {"p50": 1.5e-3}}},
        {"config": {"concurrency": 64}, "metrics": {"tpot": {"p50": 3.3e-3}}},
    ]
    assert check_figures.serving_rows(figures, serve_runs) == [
        ["1b TPOT p50 over gRPC, concurrency 1, ms", "1.50", "graph step at batch 1: 1.00", "1.50", "", ""],
        [
            "1b TPOT p50 over gRPC, concurrency 64, ms",
            "3.30",
            "graph step at batch 64: 3.00",
            "1.10",
            "<= 1.2",
            "met",
        ],
    ]


# ---- sluice.benchmarks.gpu -------------------------------------------------------------------------


def test_the_8b_floors_follow_from_its_parameter_counts():
    numbers = check_figures.model_numbers("llama-3-8b")
    assert numbers["weight_bytes"] == 2 * 8_030_261_248
    assert numbers["body_params"] == 8_030_261_248 - 2 * 128256 * 4096  # embedding and untied head out
    # 2 flops per body parameter per token, causal attention in 32 layers, the head once.
    attention = 32 * 2 * 2 * 32 * 128 * 4096 * 4097 / 2
    expected = 2 * numbers["body_params"] * 4096 + attention + 2 * 128256 * 4096
    assert check_figures.prompt_flops(numbers, 4096) == pytest.approx(expected, rel=1e-12)
    figures = {"ceilings": {"copy_bytes_per_s": 4e12, "bf16_matmul_flops_per_s": 8e14}}
    runs = [
        {
            "config": {"workload": {"input_len": 4096}},
            "metrics": {"tpot": {"p50": 5e-3}, "ttft": {"p50": 0.11}},
        }
    ]
    tpot, ttft = check_figures.large_rows(figures, runs, numbers)
    assert tpot[:4] == ["8b batch-1 TPOT p50 over gRPC, ms", "5.00", "floor 4.02", "0.80"]
    assert tpot[5] == "met"  # 4.015 ms / 5 ms = 0.803 of the floor's speed
    assert ttft[2] == f"FLOP floor {expected / 8e14 * 1e3:.1f}" and ttft[5] == "NOT met"  # 110 ms vs 77 ms


def test_greedy_comparison_tells_equal_near_ties_and_mismatches():
    def sample(tokens, tops):
        return {"tokens": tokens, "top": tops}

    top = [[[5, -1.0], [6, -1.05], [7, -3.0]]]
    reference = [sample([5, 1], top * 2), sample([5], top), sample([5], top), sample([5, 1], top * 2)]
    candidate = [
        sample([5, 1], top * 2),  # equal
        sample([6], [[[6, -1.0], [5, -1.04]]]),  # parts at a near tie: 0.05 and 0.04 nats
        sample([7], [[[7, -1.0], [5, -2.0]]]),  # parts where the reference put 2 nats between them
        sample([5], top),  # shorter
    ]
    verdicts = greedy_compare.compare_greedy(reference, candidate, near_tie_nats=0.1)
    assert [v.kind for v in verdicts] == ["equal", "near tie", "mismatch", "mismatch"]
    assert verdicts[1].position == 0 and verdicts[1].gap == pytest.approx(0.05)
    summary = greedy_compare.summarize(verdicts)
    assert (summary["equal"], summary["near tie"], summary["mismatch"]) == (1, 1, 2)
    assert summary["details"][1] == "sample 2: mismatch, token 5 vs 7 at position 0: 2.0000 nats apart"
    assert summary["details"][2] == "sample 3: mismatch, 2 vs 1 tokens"
    with pytest.raises(ValueError, match="^candidate: 1 samples, the reference has 4$"):
        greedy_compare.compare_greedy(reference, candidate[:1], 0.1)


def test_greedy_prompts_repeat_a_motif_inside_the_vocabulary():
    prompts = greedy_compare.greedy_prompts(3, vocab_size=100, seed=1)
    assert len(prompts) == 3 and all(len(p) == 44 and p[:12] == p[12:24] == p[24:36] for p in prompts)
    assert all(3 <= t < 100 for p in prompts for t in p)
    assert prompts == greedy_compare.greedy_prompts(3, vocab_size=100, seed=1)


@pytest.mark.parametrize(
    "value",
    [
        {"id": 5, "paid": True, "color": "red"},
        {"id": 5, "paid": True},
        {"id": 1000, "paid": True, "color": "red"},
        {"id": 5.5, "paid": True, "color": "red"},
        {"id": True, "paid": True, "color": "red"},
        {"id": 5, "paid": 1, "color": "red"},
        {"id": 5, "paid": True, "color": "pink"},
        {"id": 5, "paid": True, "color": "red", "x": 1},
        [1, 2],
    ],
)
def test_the_schema_check_by_hand_agrees_with_jsonschema(value):
    assert bool(_errors_by_hand(value)) == bool(schema_errors(value))


def test_a_borrowed_tokenizer_widens_a_small_vocabulary_only(tmp_path):
    tokenizer_dir = tmp_path / "tok"
    assert borrowed_tokenizer.export_smollm2_tokenizer(tokenizer_dir) == 49152
    tiny = borrowed_tokenizer.write_model_dir("tiny", tokenizer_dir, tmp_path / "tiny")
    one_b = borrowed_tokenizer.write_model_dir("llama-3.2-1b", tokenizer_dir, tmp_path / "1b")
    assert tiny["vocab_size"] == 49152 and one_b["vocab_size"] == 128256
    assert json.loads((tmp_path / "1b" / "config.json").read_text())["hidden_size"] == 2048
    from transformers import AutoTokenizer  # the tokenizer loads where transformers reads it

    text = "Describe a paint order as JSON."
    ours = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert ours.decode(ours(text)["input_ids"], skip_special_tokens=True) == text
    with pytest.raises(
        ValueError, match="^tokenizer_dir: '.*' has no tokenizer.json, tokenizer_config.json$"
    ):
        borrowed_tokenizer.write_model_dir("tiny", tmp_path / "missing", tmp_path / "x")
    with pytest.raises(ValueError, match="^preset: unknown 'huge'"):
        borrowed_tokenizer.write_model_dir("huge", tokenizer_dir, tmp_path / "x")


def test_wait_gone_tells_an_exited_process_from_a_live_one():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert step_context.wait_gone(child.pid, timeout=5.0)
    assert not step_context.wait_gone(os.getpid(), timeout=0.3)


def test_a_variant_server_keeps_only_its_own_kv_cache_and_backend_log_lines(tmp_path: Path):
    log = tmp_path / "servers.log"
    log.write_text("INFO model_runner: KV cache: 10 blocks of 16 tokens (the server before)\n")
    start = log.stat().st_size
    with log.open("a") as f:
        f.write("\n==== fp8: sluice serve --quantization fp8\n"
                "INFO model_runner: KV cache: 9 blocks of 16 tokens\n"
                "INFO server: listening\nINFO selector: attention backend triton\n")  # fmt: skip
    assert variant_servers.server_notes(log, start) == [
        "INFO model_runner: KV cache: 9 blocks of 16 tokens",
        "INFO selector: attention backend triton",
    ]


def test_a_reference_server_keeps_its_prompts_and_a_variant_its_comparison():
    samples = [{"tokens": [1, 2, 3], "top": []}]
    assert variant_servers.set_against(None, [[5, 6]], samples, 0.1) == {"prompts": [[5, 6]]}
    reference = {"greedy": [{"tokens": [1, 2, 4], "top": []}]}
    result = variant_servers.set_against(reference, [[5, 6]], samples, 0.1)
    assert list(result) == ["comparison", "agreement"]
    assert result["comparison"]["mismatch"] == 1
    assert result["agreement"]["tokens_before_first_difference"] == 2


def test_the_report_sets_a_gpu_run_against_issue_33s_table(tmp_path: Path):
    # Issue 33's own H200 figures, as the steps would record them: the report must reproduce its gaps.
    def run(concurrency: int, tpot: float, ttft: float) -> dict:
        metrics = {"num_requests": 64, "num_completed": 64, "errors": {}, "output_throughput": 100.0,
                   "tpot": {"p50": tpot, "p99": tpot}, "ttft": {"p50": ttft}}  # fmt: skip
        return {"config": {"concurrency": concurrency, "workload": {"input_len": 4096}}, "metrics": metrics}

    figures = {
        "ceilings": {"copy_bytes_per_s": 4.2e12, "bf16_matmul_flops_per_s": 7.9e14},
        "decode": {"floor_s": 5.9e-4, "graph_step_s": {"1": 1.72e-3, "64": 2.2e-3}},
        "attention": {"rows": [{"context": 32768, "batch": 8, "gb_per_s": 1785.0, "of_copy_bw": 0.425}]},
    }
    records = [{"step": "gpu_check", "section": key, "figures": value} for key, value in figures.items()]
    baseline = run(1, 5.7e-3, 0.2124)  # the large step's second server, at the 2048-token step budget
    records += [
        {"step": "gpu_check", "status": "passed", "seconds": 130, "limit_s": 240, "note": "exit status 0"},
        {"step": "large", "status": "timed out", "seconds": 180, "limit_s": 180, "note": "exit status 124"},
        {"step": "large", "model_info": {"max_num_batched_tokens": 8192}, "baseline_runs": [baseline]},
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "bench_serve.json").write_text(
        json.dumps({"runs": [run(1, 2.1e-3, 0.01), run(64, 3.6e-3, 0.05)]})
    )
    (tmp_path / "bench_large.json").write_text(json.dumps({"runs": [run(1, 5.6e-3, 0.177)]}))
    text, ok = check_report.build_report(tmp_path, "gpu", 431, 470)
    assert (
        not ok
        and text.splitlines()[0].startswith("# Sluice GPU check: ")
        and text.splitlines()[0].endswith(": FAIL")
    )
    for row in (
        "| paged decode attention, 32k x 8, GB/s | 1785 | copy 4200 | 0.42 | >= 0.70 | NOT met |",
        "| 1b batch-1 decode step (CUDA graph), ms | 1.72 | floor 0.59 | 2.92 | <= 1.5 | NOT met |",
        "| 1b TPOT p50 over gRPC, concurrency 64, ms | 3.60 | graph step at batch 64: 2.20 | 1.64 | <= 1.2 |",
        "| 8b batch-1 TPOT p50 over gRPC, ms | 5.60 | floor 3.82 | 0.68 | floor/TPOT >= 0.8 | NOT met |",
        "| 8b TTFT p50, 4096-token prompt, ms | 177.0 | FLOP floor 77.9 | 2.27 | <= 1.3 | NOT met |",
        "| 8b TTFT p50, 4096-token prompt, step budget 2048, ms | 212.4 "
        "| the default budget's (8192) 177.0 | 1.20 |",
        "| large | llama-3-8b shape: batch-1 TPOT, 4096-token TTFT | TIMED OUT | 180 | 180 |",
        "| serve_bench | sluice serve + greedy reference + sluice bench --sweep 1,16,64 | NOT RUN |  |  |  |",
    ):
        assert row in text, row


def test_agreement_counts_equal_samples_and_tokens_before_the_first_difference():
    def samples(*token_lists):
        return [{"tokens": list(tokens), "top": []} for tokens in token_lists]

    reference = samples([1, 2, 3], [4, 5], [6, 7, 8])
    candidate = samples([1, 2, 9], [4, 5], [6, 7])  # parts at 2; equal; shorter (parts where it ends)
    assert greedy_compare.agreement(reference, candidate) == {
        "samples": 3,
        "equal": 1,
        "tokens_before_first_difference": 2 + 2 + 2,
        "tokens": 8,
    }
    with pytest.raises(ValueError, match="^candidate: 2 samples, the reference has 3$"):
        greedy_compare.agreement(reference, candidate[:2])


def test_fp8_weights_halve_what_a_batch1_step_reads_except_the_bf16_head():
    numbers = check_figures.model_numbers("llama-3-8b")
    body, head = numbers["body_params"], numbers["head_params"]
    assert fp8_figures.step_bytes_ratio("llama-3-8b") == pytest.approx(
        (body + 2 * head) / (2 * body + 2 * head)
    )
    assert fp8_figures.step_bytes_ratio("llama-3-8b") == pytest.approx(0.535, abs=5e-4)
    # llama-3.2-1b's 128k-token head is a fifth of its weights: its floor is above issue 34's 0.6 already.
    assert fp8_figures.step_bytes_ratio("llama-3.2-1b") == pytest.approx(0.606, abs=5e-4)


def _bench_run(concurrency: int, requests: int, tpot: float, throughput: float) -> dict:
    metrics = {"num_requests": requests, "num_completed": requests, "errors": {}, "ttft": {"p50": 0.01},
               "output_throughput": throughput, "tpot": {"p50": tpot, "p99": tpot}}  # fmt: skip
    return {"config": {"concurrency": concurrency}, "metrics": metrics}


def _fp8_record(
    variant: str, blocks: int, tpot_1: float, tpot_64: float, throughput: float, step: str = "fp8"
) -> dict:
    prefix = "2026-11-26 05:21:17,010 {} sluice.engine.worker.{}: "
    notes = [prefix.format("INFO", "model_runner") + "KV cache: 9 blocks of 16 tokens, torch.float8_e4m3fn"]
    if variant == "fp8_kv":
        notes.append(prefix.format("INFO", "attention.selector") + FP8_KV_TRITON_NOTE)
    return {
        "step": step, "variant": variant, "ok": True, "model_info": {"num_kv_blocks": blocks},
        "runs": [_bench_run(1, 8, tpot_1, 400.0), _bench_run(64, 64, tpot_64, throughput)],
        "comparison": {"equal": 5, "near tie": 2, "mismatch": 1, "details": ["sample 3: mismatch, ..."]},
        "agreement": {"samples": 8, "equal": 5, "tokens_before_first_difference": 200, "tokens": 256},
        "server_notes": notes,
    }  # fmt: skip


def test_the_report_sets_the_fp8_servers_against_bf16_and_issue_34s_targets(tmp_path: Path):
    records = [
        {"step": "serve_bench", "ok": True, "model_info": {"num_kv_blocks": 10000}, "greedy": []},
        _fp8_record("fp8", 11000, 1.1e-3, 3.0e-3, 14000.0),
        _fp8_record("fp8_kv", 22000, 3.0e-3, 6.0e-3, 9000.0),
        {"step": "fp8", "ok": True, "variants": ["fp8", "fp8_kv"]},
        {"step": "fp8", "status": "passed", "seconds": 70, "limit_s": 150, "note": "exit status 0"},
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    bf16_runs = [_bench_run(1, 64, 2.0e-3, 480.0), _bench_run(16, 64, 2.5e-3, 6000.0)]
    (tmp_path / "bench_serve.json").write_text(
        json.dumps({"runs": [*bf16_runs, _bench_run(64, 64, 4e-3, 1e4)]})
    )
    text, _ = check_report.build_report(tmp_path, "gpu", 400, 470)
    section = text.split("## FP8 (issue 34)")[1].split("## Checks")[0]
    for line in (
        "| bf16 (serve_bench) | 2.00 | 4.00 | 10000 | 10000 | 128/128 | the reference |",
        "| fp8 weights | 1.10 (0.55x) | 3.00 (0.75x) | 14000 (1.40x) | 11000 (1.10x) | 72/72 "
        "| 5/8 equal; 200/256 tokens before the first difference |",
        "| fp8 weights + fp8 KV | 3.00 (1.50x) | 6.00 (1.50x) | 9000 (0.90x) | 22000 (2.20x) | 72/72 |",
        "| fp8 weights: batch-1 TPOT p50 / bf16's (here llama-3.2-1b, the goal is set on llama-3-8b) | 0.55 "
        "| <= 0.6 | met |",
        "| fp8 weights: out tok/s at 64 concurrent / bf16's | 1.40 | >= 1.3 | met |",
        "| fp8 weights + fp8 KV: out tok/s at 64 concurrent / bf16's | 0.90 | >= 1.3 | NOT met |",
        "| fp8 KV: KV blocks / bf16's | 2.20 | >= 2.0 | met |",
        "| fp8 KV: KV blocks / fp8 weights' (same weights) | 2.00 |  |  |",
        "**Shape:** this run is on the llama-3.2-1b shape, not the llama-3-8b one issue 34's batch-1 target",
        "0.61 on llama-3.2-1b, 0.53 on llama-3-8b.",
        "**The fp8-KV server's speed is the Triton attention backend's, with CUDA graphs, as bf16's:**",
        "(the selector's line saying so: seen in its log)",
        "**fp8 weights vs bf16, greedy** (need not be equal: another rounding): 5 equal, 2 parting at a near "
        "tie, 1 mismatched.\n- sample 3: mismatch, ...\n- log: `KV cache: 9 blocks of 16 tokens",
        f"- log: `{FP8_KV_TRITON_NOTE}`",
    ):
        assert line in section, line
    assert (
        "| fp8 | --quantization fp8, then + --kv-cache-dtype fp8" in text and "| PASSED | 70 | 150 |" in text
    )


def test_the_fp8_section_says_what_a_step_cut_short_left_unmeasured(tmp_path: Path):
    # Killed at its limit after its first server: that server's figures, the other's "not run".
    records = [
        {"step": "serve_bench", "ok": True, "model_info": {"num_kv_blocks": 10000}, "greedy": []},
        _fp8_record("fp8", 11000, 1.3e-3, 3.0e-3, 12000.0),
        {"step": "fp8", "status": "timed out", "seconds": 150, "limit_s": 150, "note": "exit status 124"},
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "bench_serve.json").write_text(json.dumps({"runs": [_bench_run(1, 64, 2e-3, 480.0)]}))
    text, ok = check_report.build_report(tmp_path, "gpu", 400, 470)
    assert not ok
    for line in (
        "| bf16 (serve_bench) | 2.00 | - | - | 10000 | 64/64 | the reference |",  # no c=64 run recorded
        "| fp8 weights | 1.30 (0.65x) | 3.00 | 12000 | 11000 (1.10x) | 72/72 |",
        "| fp8 weights + fp8 KV | - | - | - | - | - | not run |",
        "(here llama-3.2-1b, the goal is set on llama-3-8b) | 0.65 | <= 0.6 | NOT met |",
        "| fp8 weights: out tok/s at 64 concurrent / bf16's | - | >= 1.3 | not measured |",
        "| fp8 KV: KV blocks / bf16's | - | >= 2.0 | not measured |",
        "(the selector's line saying so: not found in its log)",
    ):
        assert line in text, line
    assert "KV blocks / fp8 weights'" not in text
    (tmp_path / "results.jsonl").write_text(
        json.dumps(
            {
                "step": "fp8",
                "status": "skipped",
                "seconds": 0,
                "limit_s": 60,
                "note": "60s left of the 470s budget, needs 90s",
            }
        )
        + "\n"  # fmt: skip
    )
    text, ok = check_report.build_report(tmp_path, "gpu", 400, 470)
    assert ok and "Not measured: the fp8 step SKIPPED (60s left of the 470s budget, needs 90s)." in text


def test_the_fp8_large_section_sets_the_8b_fp8_servers_against_the_steps_own_bf16(tmp_path: Path):
    # On the goal's shape; the bf16 server is the step's own (no serve_bench in this run at all).
    bf16 = _fp8_record("bf16", 5000, 5.6e-3, 9.0e-3, 6000.0, step="fp8_large")
    for key in ("comparison", "agreement"):
        del bf16[key]
    records = [
        bf16,
        _fp8_record("fp8", 6500, 3.2e-3, 6.3e-3, 8400.0, step="fp8_large"),
        {
            "step": "fp8_large",
            "status": "timed out",
            "seconds": 330,
            "limit_s": 330,
            "note": "exit status 124",
        },
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text, ok = check_report.build_report(tmp_path, "gpu", 350, 340)
    assert not ok
    section = text.split("## FP8 on the llama-3-8b shape (issue 34)\n\n")[1].split("\n## ")[0]
    assert section.startswith("The llama-3-8b preset (bfloat16) on 4 servers of this step")
    for line in (
        "| greedy vs bf16 |",
        "| bf16 (this step's) | 5.60 | 9.00 | 6000 | 5000 | 72/72 | the reference |",
        "| fp8 weights | 3.20 (0.57x) | 6.30 (0.70x) | 8400 (1.40x) | 6500 (1.30x) | 72/72 "
        "| 5/8 equal; 200/256 tokens before the first difference |",
        "| fp8 weights + fp8 KV | - | - | - | - | - | not run |",  # killed at the limit before it
        "| fp8 weights, 128 x 128 blocks | - | - | - | - | - | not run |",
        "The servers of fp8 weights with the RMSNorms (and SiLU-and-mul) in the linears did not run: off by "
        "default since run 16, where they were slower; `SLUICE_GPU_CHECK_OFF_OPTIONS=1` serves them.",
        "| fp8 weights: batch-1 TPOT p50 / bf16's (the goal's shape) | 0.57 | <= 0.6 | met |",
        "| fp8 weights: out tok/s at 64 concurrent / bf16's | 1.40 | >= 1.3 | met |",
        "| fp8 weights + fp8 KV: out tok/s at 64 concurrent / bf16's | - | >= 1.3 | not measured |",
        "| fp8 KV: KV blocks / bf16's | - | >= 2.0 | not measured |",
        "**Shape:** this run is on the llama-3-8b shape. The weight bytes a batch-1 step reads, fp8 over "
        "bf16 (lm_head stays bf16), the floor of that TPOT ratio: 0.61 on llama-3.2-1b, 0.53 on llama-3-8b.",
        "**fp8 weights vs bf16, greedy** (need not be equal: another rounding): 5 equal, 2 parting at a near "
        "tie, 1 mismatched.",
    ):
        assert line in section, line
    assert "RMSNorms in the linears |" not in section  # the folds' rows: not planned, not recorded
    assert (
        "| fp8_large | llama-3-8b shape in bf16, fp8, fp8 + fp8 KV, fp8 128-blocks (fp8 with norms folded: "
        "SLUICE_GPU_CHECK_OFF_OPTIONS=1)"
        in text
        and "| TIMED OUT | 330 |" in text
    )
    # The fp8 step's section, with no serve_bench or fp8 record, says why it has no figures.
    assert "Not measured: the fp8 step NOT RUN." in text

    (tmp_path / "results.jsonl").write_text(
        json.dumps({"step": "fp8_large", "status": "skipped", "seconds": 0, "limit_s": 0,
                    "note": "not in SLUICE_GPU_CHECK_STEPS (runs only when named there)"}) + "\n"
    )  # fmt: skip
    text, ok = check_report.build_report(tmp_path, "gpu", 400, 470)
    assert ok and (
        "## FP8 on the llama-3-8b shape (issue 34)\n\nNot measured: the fp8_large step SKIPPED "
        "(not in SLUICE_GPU_CHECK_STEPS (runs only when named there))." in text
    )


def test_the_fp8_large_section_lists_the_folded_servers_planned_or_recorded(tmp_path: Path, monkeypatch):
    """With SLUICE_GPU_CHECK_OFF_OPTIONS=1 the folds' servers are planned: their rows say "not run" until
    they record figures; without it, a fold's record (a call with the knob, its report rebuilt here by
    merge_calls) still gets its row, and the section no longer says they did not run."""
    bf16 = _fp8_record("bf16", 5000, 5.6e-3, 9.0e-3, 6000.0, step="fp8_large")
    records = [bf16, _fp8_record("fp8", 6500, 3.2e-3, 6.3e-3, 8400.0, step="fp8_large")]

    def section() -> str:
        (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        text, _ = check_report.build_report(tmp_path, "gpu", 350, 340)
        return text.split("## FP8 on the llama-3-8b shape (issue 34)\n\n")[1].split("\n## ")[0]

    monkeypatch.setenv(step_context.OFF_OPTIONS_ENV, "1")
    text = section()
    assert text.startswith("The llama-3-8b preset (bfloat16) on 6 servers of this step")
    assert "| fp8 weights, RMSNorms in the linears | - | - | - | - | - | not run |" in text
    assert "| fp8 weights, RMSNorms and SiLU-and-mul in the linears | - | - | - | - | - | not run |" in text
    assert "(RMSNorms in the linears: `--fuse-norm-fp8`" in text and "did not run" not in text

    monkeypatch.delenv(step_context.OFF_OPTIONS_ENV)
    records.append(_fp8_record("fp8_norm", 6500, 3.9e-3, 6.3e-3, 8400.0, step="fp8_large"))
    text = section()
    assert text.startswith("The llama-3-8b preset (bfloat16) on 5 servers of this step")
    assert "| fp8 weights, RMSNorms in the linears | 3.90 (0.70x) |" in text
    assert "RMSNorms and SiLU-and-mul in the linears |" not in text and "did not run" not in text


def test_the_async_section_lists_the_skinny_server_planned_or_recorded(tmp_path: Path, monkeypatch):
    """On a GPU without SLUICE_GPU_CHECK_OFF_OPTIONS the skinny linears' server is not planned: no row, and
    the section says why and how to serve it; with the knob its row says "not run" until it records
    figures; a skinny record gets its row either way."""
    comparison = {"equal": 8, "near tie": 0, "mismatch": 0, "details": []}
    agreement = {"samples": 8, "equal": 8, "tokens_before_first_difference": 256, "tokens": 256}
    served = {"ok": True, "model_info": {"num_kv_blocks": 9000}, "comparison": comparison, "step": "async"}
    served["agreement"] = agreement
    records = [
        {"step": "serve_bench", "ok": True, "model_info": {"num_kv_blocks": 9000}, "greedy": []},
        {
            **served,
            "variant": "async",
            "runs": [_bench_run(1, 8, 1.2e-3, 800.0), _bench_run(64, 256, 2e-3, 3e4)],
        },
    ]
    (tmp_path / "bench_serve.json").write_text(json.dumps({"runs": [_bench_run(1, 64, 1.5e-3, 620.0)]}))

    def section() -> str:
        (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        text, _ = check_report.build_report(tmp_path, "gpu", 350, 470)
        return text.split("## Async scheduling (issue 33): --async-scheduling vs synchronous\n\n")[1].split(
            "\n## "
        )[0]

    text = section()
    assert (
        "the `--async-scheduling` server ran `sluice bench`" in text
        and "| --async-scheduling | 1.20 (0.80x) |" in text
    )
    assert "--skinny-linears |" not in text
    assert (
        "The servers of Sluice's skinny linears (`--skinny-linears`) did not run: off by default since run "
        "16, where they were slower; `SLUICE_GPU_CHECK_OFF_OPTIONS=1` serves them." in text
    )
    monkeypatch.setenv(step_context.OFF_OPTIONS_ENV, "1")
    text = section()
    assert "| --async-scheduling --skinny-linears | - | - | - | - | - | not run |" in text
    assert "the second with Sluice's skinny linears" in text and "skinny-linears`) did not run" not in text
    monkeypatch.delenv(step_context.OFF_OPTIONS_ENV)
    records.append({**records[1], "variant": "async_skinny", "runs": [_bench_run(1, 8, 1.5e-3, 700.0)]})
    text = section()
    assert "| --async-scheduling --skinny-linears | 1.50 (1.00x) |" in text
    assert "skinny-linears`) did not run" not in text
    # the speculating servers: planned with SLUICE_GPU_CHECK_SPEC_ASYNC=1, else a line says how to serve them
    ngram, paused = ASYNC_LABELS["async_ngram"], ASYNC_LABELS["async_ngram_pause"]
    assert f"| {ngram} |" not in text and "`SLUICE_GPU_CHECK_SPEC_ASYNC=1` serves them" in text
    monkeypatch.setenv(step_context.SPEC_ASYNC_ENV, "1")
    text = section()
    assert f"| {ngram} | - | - | - | - | - | not run |" in text and f"| {paused} | - |" in text
    assert "the last two speculating, `--speculative ngram`" in text and "SPEC_ASYNC=1` serves" not in text
    greedy = [
        {"draft_tokens": 9, "accepted_draft_tokens": 6},
        {"draft_tokens": 3, "accepted_draft_tokens": 1},
    ]
    speculating = {**records[1], "variant": "async_ngram", "greedy": greedy}
    records.append({**speculating, "runs": [_bench_run(1, 8, 0.9e-3, 900.0)]})
    text = section()
    assert f"| {ngram} | 0.90 (0.60x) |" in text and f"| {paused} | - |" in text
    assert f"**Greedy, {ngram} vs synchronous** (must be equal, near ties aside): 8 equal" in text
    assert "0 mismatched; 7/12 drafts accepted." in text


OFF_OPTIONS = [("gpu", None), ("gpu", "1"), ("cpu", "1")]  # (mode, SLUICE_GPU_CHECK_OFF_OPTIONS)


@pytest.mark.parametrize(("mode", "off_options"), OFF_OPTIONS)
def test_the_fp8_large_step_serves_the_folded_inputs_when_asked_before_the_blocks(
    mode, off_options, tmp_path, monkeypatch
):
    """fp8_large's servers and their arguments, the servers stubbed, as `serve_checks.run_step` runs the
    step: bf16, fp8, fp8 + fp8 KV, with SLUICE_GPU_CHECK_OFF_OPTIONS=1 on a GPU fp8 with --fuse-norm-fp8
    and fp8 with --fuse-silu-fp8 too (never in the CPU mode: Plan.fp8_norm_serve_args,
    fp8_fold_serve_args; run 16 left them off), fp8 in blocks last."""
    served = []

    def serve(ctx, reference, name, extra, preset=None, profile=False):
        served.append((name, extra[1:]))  # after --async-scheduling
        assert extra[0] == "--async-scheduling" and preset == ctx.plan.large_preset and profile
        return {"ok": True}

    monkeypatch.setattr(variant_servers, "variant_server", serve)
    if off_options is not None:
        monkeypatch.setenv(step_context.OFF_OPTIONS_ENV, off_options)
    assert serve_checks.run_step("fp8_large", tmp_path, mode, None) == serve_checks.EXIT_PASSED
    fp8 = ("--quantization", "fp8")
    expected = [("bf16", ()), ("fp8", fp8), ("fp8_kv", (*fp8, "--kv-cache-dtype", "fp8"))]
    if mode == "gpu" and off_options == "1":
        expected.append(("fp8_norm", (*fp8, "--fuse-norm-fp8")))
        expected.append(("fp8_fold", (*fp8, "--fuse-norm-fp8", "--fuse-silu-fp8")))
    expected.append(("fp8_block", (*fp8, "--fp8-weight-block", "128")))
    assert served == expected
    (record,) = step_context.read_results(tmp_path)
    assert record["ok"] and record["variants"] == [name for name, _ in expected]


@pytest.mark.parametrize(("mode", "off_options"), OFF_OPTIONS)
def test_the_async_step_serves_the_skinny_linears_after_cublas_when_asked(
    mode, off_options, tmp_path, monkeypatch
):
    """The async step's servers and their arguments, the servers stubbed: --async-scheduling, then, on a
    GPU with SLUICE_GPU_CHECK_OFF_OPTIONS=1, with --skinny-linears too (Plan.skinny_serve_args; never in
    the CPU mode)."""
    served = []

    def serve(ctx, reference, name, extra, profile):
        served.append((name, extra))
        assert not profile  # profiles come with the speculating servers only
        return {"ok": True, "comparison": {"mismatch": int(name == "async_skinny")}}  # reported, not failed

    monkeypatch.setattr(variant_servers, "variant_server", serve)
    environ = {} if off_options is None else {step_context.OFF_OPTIONS_ENV: off_options}
    ctx = step_context.StepContext(tmp_path, step_context.plan_for(mode, environ), "async")
    monkeypatch.setattr(ctx, "reference", lambda: {"prompts": []})
    result = variant_servers.step_async(ctx)
    expected = [("async", ("--async-scheduling",))]
    if mode == "gpu" and off_options == "1":
        expected.append(("async_skinny", ("--async-scheduling", "--skinny-linears")))
    assert served == expected and result == {"ok": True, "variants": [name for name, _ in expected]}


def _speculating_server(drafts: int, mismatch: int):
    """A stub of `variant_server` whose speculating servers' greedy samples drafted `drafts` tokens and
    mismatched `mismatch` samples; the servers it was asked for, in `served`, and whether it profiled them."""
    served = []

    def serve(ctx, reference, name, extra, profile):
        served.append((name, extra, profile))
        speculating = name in variant_servers.SPEC_VARIANTS
        sample = {"draft_tokens": drafts if speculating else 0, "accepted_draft_tokens": 0}
        return {"ok": True, "comparison": {"mismatch": mismatch * speculating}, "greedy": [sample]}

    return serve, served


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_the_async_step_serves_the_speculating_servers_last_when_asked(mode, tmp_path, monkeypatch):
    """With SLUICE_GPU_CHECK_SPEC_ASYNC=1 the async step serves --speculative ngram under async scheduling,
    then paused from 16 running requests, after its other servers, in both modes, profiling the first
    speculating server's steps; each must give the synchronous server's greedy tokens with drafts
    verified, or the step fails."""
    environ = {step_context.SPEC_ASYNC_ENV: "1"}
    ctx = step_context.StepContext(tmp_path, step_context.plan_for(mode, environ), "async")
    monkeypatch.setattr(ctx, "reference", lambda: {"prompts": []})
    serve, served = _speculating_server(drafts=5, mismatch=0)
    monkeypatch.setattr(variant_servers, "variant_server", serve)
    result = variant_servers.step_async(ctx)
    ngram = ("--async-scheduling", "--speculative", "ngram")
    assert served == [
        ("async", ("--async-scheduling",), False),
        ("async_ngram", ngram, True),
        ("async_ngram_pause", (*ngram, "--speculative-disable-by-batch-size", "16"), False),
    ]
    assert result == {"ok": True, "variants": ["async", "async_ngram", "async_ngram_pause"]}
    for drafts, mismatch in ((0, 0), (5, 1)):  # no drafts verified; a greedy sample that differs
        monkeypatch.setattr(variant_servers, "variant_server", _speculating_server(drafts, mismatch)[0])
        assert not variant_servers.step_async(ctx)["ok"]
