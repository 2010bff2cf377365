"""Where a served step's device time goes: the engine core's torch.profiler (SMG's StartProfile, `sluice serve
--profile-dir`) over a few decode steps at batch 1 and at the plan's top concurrency, on a variant server
(the fp8_large step's three), once its benchmark runs are over.

For each batch size b: b streaming requests of the plan's prompt length (random ids, so no prefix-cache
hits), greedy, EOS ignored, with room for many more tokens than the profile needs; once every one has its
first token (all prefilled: the steps that follow are pure decodes of b rows), StartProfile(num_steps) into
OUT/profiles/<step>-<server>/b<b>; once the core has written the profile the requests are cancelled. So
every profiled step has all b rows whatever the machine's speed (a request that ends first fails the
profile, saying so). The summary JSON (`sluice.engine.core.step_profiler`) goes into the server's record;
the report tabulates its kernels per step (`profile_tables`).

Then a burst: prefill_batch such requests sent at once, with StartProfile before them, over prefill_steps
forward steps (the prompts' chunks first, then the first decodes): where a prompt step's time goes.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from smg_grpc_proto import vllm_engine_pb2_grpc as smg_grpc
from smg_grpc_proto.generated import common_pb2

from sluice.benchmarks.gpu.markdown_table import markdown_table
from sluice.client import Client, generate_request

PROFILES_DIR = "profiles"
WAIT_S = 300.0  # for every request's first token (a batch of long prompts on a slow machine)
SUMMARY_WAIT_S = 60.0  # then for the profile to be written (12 steps; the profiler's start and export)
POLL_S = 0.05
TOP_KERNELS = 10  # rows of a profile's table
NAME_WIDTH = 72  # kernel names are cut to this many characters in the report


@dataclass(frozen=True)
class ProfilePlan:
    batches: tuple[int, ...]  # the batch sizes profiled, one after another
    num_steps: int  # forward steps in each profile
    prompt_len: int
    max_tokens: int  # per request, at most (cut to the context): the requests are cancelled once profiled
    prefill_batch: int  # then a burst of this many prompts, profiled from its first step
    prefill_steps: int  # ... over this many forward steps (the prompts' chunks, then the first decodes)


class _Run(NamedTuple):
    name: str  # "b<batch>" (pure decodes) or "prefill<batch>" (a burst of prompts)
    batch: int
    num_steps: int
    burst: bool  # StartProfile before the requests are sent, not once all have their first token


def profile_server(
    target: str, profile_dir: Path, label: str, plan: ProfilePlan, info: dict[str, Any]
) -> dict:
    """The profiles of one server (started with --profile-dir `profile_dir`; `info`: its model info):
    {"b<b>" per batch size, then "prefill<b>": summary or {"error": ...}}, written under
    profile_dir / label / that name."""
    max_tokens = min(plan.max_tokens, info["max_model_len"] - plan.prompt_len)
    runs = [_Run(f"b{batch}", batch, plan.num_steps, False) for batch in plan.batches]
    runs.append(_Run(f"prefill{plan.prefill_batch}", plan.prefill_batch, plan.prefill_steps, True))
    profiles: dict[str, Any] = {}
    for run in runs:
        prompts = _prompts(f"profile-{label}/{run.name}", run.batch, plan.prompt_len, info["vocab_size"])
        try:
            summary = _profile(target, profile_dir, f"{label}/{run.name}", run, prompts, max_tokens)
        except (grpc.RpcError, OSError, RuntimeError, ValueError) as exc:
            summary = {"error": f"{type(exc).__name__}: {exc}"}
        profiles[run.name] = summary
    return profiles


def _prompts(seed: str, count: int, length: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(length)] for _ in range(count)]


def _profile(
    target: str, profile_dir: Path, relative: str, run: _Run, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """One profile into profile_dir / relative, of `run.num_steps` steps while `prompts` are served: from
    before they are sent (a burst), or once every one has its first token (pure decodes)."""
    prefilled, done = threading.Semaphore(0), threading.Event()
    start = common_pb2.StartProfileRequest(output_dir=relative, num_steps=run.num_steps)
    with Client(target) as client, ThreadPoolExecutor(max_workers=run.batch) as pool:
        if run.burst:
            _start_profile(target, start)
        requests = [
            pool.submit(_run_request, client, prompt, max_tokens, prefilled, done) for prompt in prompts
        ]
        try:
            for _ in range(run.batch):
                if not prefilled.acquire(timeout=WAIT_S):
                    raise RuntimeError(f"no first token from every request within {WAIT_S:.0f} s")
            if not run.burst:
                _start_profile(target, start)
            summary_path = _wait_for_summary(profile_dir / relative, requests)
        finally:
            done.set()  # the requests end here (cancelled): no request finished inside the profile
        tokens = [request.result() for request in requests]
    summary = json.loads(summary_path.read_text())
    summary["requests"] = {"batch": run.batch, "max_tokens": max_tokens, "tokens_at_cancel": tokens}
    return summary


def _start_profile(target: str, request: common_pb2.StartProfileRequest) -> None:
    with grpc.insecure_channel(target) as channel:
        smg_grpc.VllmEngineStub(channel).StartProfile(request, timeout=30)


def _wait_for_summary(directory: Path, runs: list) -> Path:
    """The profile's summary once the core has written it; RuntimeError if a request ended first (a
    finished request would change the batch) or after SUMMARY_WAIT_S seconds."""
    deadline = time.monotonic() + SUMMARY_WAIT_S
    while time.monotonic() < deadline:
        written = sorted(directory.glob("profile-*.json"))
        if written:
            return written[-1]
        if any(run.done() for run in runs):
            raise RuntimeError("a request ended before the profile was written (max_tokens too small)")
        time.sleep(POLL_S)
    raise RuntimeError(f"no profile written under {directory} within {SUMMARY_WAIT_S:.0f} s")


def _run_request(
    client: Client, prompt: list[int], max_tokens: int, prefilled: threading.Semaphore, done: threading.Event
) -> int:
    """Streams until `done` (then cancels) or the end; releases `prefilled` once, at its first token (or on
    failing before it). Returns the tokens it got."""
    request = generate_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, signalled = 0, False
    try:
        for chunk in client.generate(request, timeout=WAIT_S * 2):
            tokens += len(chunk.token_ids)
            if tokens and not signalled:
                prefilled.release()
                signalled = True
            if done.is_set():
                break  # leaving the stream cancels the call: the server aborts the request
    finally:
        if not signalled:
            prefilled.release()
    return tokens


def profile_tables(servers: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown for the profiles of each server: per batch size, the device's busy time per step and the
    kernels taking most of it (exclusive microseconds per step, share, launches per step)."""
    parts = []
    for server, profiles in servers.items():
        for batch, summary in profiles.items():
            if batch.startswith("prefill"):
                title = (
                    f"**{server}, a burst of {batch.removeprefix('prefill')} prompts from its first step**"
                )
            else:
                # Sequences, not rows: a speculating server's steps verify several rows of each.
                batch_size = int(batch.removeprefix("b"))
                title = f"**{server}, {batch_size} sequence{'' if batch_size == 1 else 's'} a step**"
            if "error" in summary:
                parts.append(f"{title}: not profiled ({summary['error']})")
                continue
            parts.append(profile_table(title, summary))
    return parts


def profile_table(title: str, summary: dict[str, Any], top: int = TOP_KERNELS) -> str:
    """A profile's markdown: its title and totals, then the `top` kernels by device time (operators by
    CPU time where nothing ran on a device). A kernel's device time is its exclusive time where the summary
    has it (the part of its interval no earlier kernel covered: a kernel launched early under programmatic
    dependent launch does not count its wait for the one before), its whole duration in older summaries."""
    steps = max(1, summary["steps"])
    tokens = summary["rows_per_step"]
    shape = (
        f"{summary['steps']} steps of {tokens[0]} rows"
        if len(set(tokens)) == 1
        else f"tokens a step {tokens}"
    )
    if summary["measured"] != "device":
        entries = summary["top"][:top]
        rows = [_row(entry, entry["self_cpu_us"], summary["cpu_us_total"], steps) for entry in entries]
        head = f"{title}: {shape}, CPU only (no device): CPU us per step"
        return head + "\n\n" + markdown_table(["operator", "us / step", "share", "calls / step"], rows)
    wall = f"wall {summary['wall_s'] / steps * 1e3:.2f} ms a step while profiled"
    kernels = sorted((entry for entry in summary["top"] if entry["on_device"]), key=kernel_us, reverse=True)
    total_us = busy_us(summary)
    if "device_busy_us_total" in summary:
        head = (
            f"{title}: {shape}; device busy {total_us / steps:.0f} us a step (kernels overlapping under "
            f"programmatic dependent launch: {summary['device_overlap_us'] / steps:.0f} us a step counted "
            f"once, from the earlier kernel's end), {wall}"
        )
    else:
        head = f"{title}: {shape}; device time {total_us / steps:.0f} us a step, {wall}"
    rows = [_row(entry, kernel_us(entry), total_us, steps) for entry in kernels[:top]]
    return head + "\n\n" + markdown_table(["kernel", "us / step", "share", "launches / step"], rows)


def kernel_us(entry: dict[str, Any]) -> float:
    """A kernel's device time in a summary: its exclusive time (`step_profiler.exclusive_us`), its whole
    duration in a summary written before the exclusive times."""
    return entry.get("exclusive_device_us", entry["self_device_us"])


def busy_us(summary: dict[str, Any]) -> float:
    """The device's busy time over a profile, kernels overlapping counted once (their durations' sum in a
    summary written before the exclusive times)."""
    return summary.get("device_busy_us_total", summary["device_us_total"])


def _row(entry: dict[str, Any], us: float, total_us: float, steps: int) -> list[object]:
    name = entry["name"] if len(entry["name"]) <= NAME_WIDTH else entry["name"][: NAME_WIDTH - 3] + "..."
    share = f"{100 * us / total_us:.1f}%" if total_us > 0 else "-"
    return [f"`{name}`", f"{us / steps:.1f}", share, f"{entry['count'] / steps:g}"]
