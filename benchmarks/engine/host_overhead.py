"""The engine's host time per decode step, the forward excluded.

    python -m sluice.benchmarks.engine.host_overhead [--batch 1 64 256] [--steps 40] [--json out.json]
        [--async-scheduling off|on|both] [--forward run|replay] [--speculative ngram|draft]

Model: the embedded SmolLM2-135M's shape, tokenizer and 49152-token vocabulary with random weights and
only `--num-layers` decoder layers (default 2), so the forward is short and the host's work (which does
not depend on the depth) is most of the step; the engine's default settings (prefix caching on, which
random prompts never hit), max_num_seqs the largest batch, one torch thread (`--num-threads`). For each
batch size B, B requests with seeded 64-token prompts are prefilled, then `--steps` pure decode steps
of B requests are timed, phase by phase, the way a server runs them:

    core     schedule | inputs (SchedulerOutput -> tensors) | forward (model + lm_head) | sample |
             update (scheduler update, CoreOutput building) | the rest of EngineCore.step
    ipc      CoreOutputs encoded (core) and decoded (frontend), msgpack as over ZeroMQ
    frontend OutputProcessor.process (of which: detokenization)

host = step - forward + ipc + frontend. The phases are timed by wrapping the engine's methods from
outside (time.perf_counter_ns for wall time, time.thread_time_ns for this thread's CPU time, which a
busy shared machine disturbs less); nothing in the engine is changed. Prints a table of medians (and
host p90) and writes every step's figures with --json.

`--speculative ngram` (k = `--num-speculative-tokens`): every request drafts by prompt lookup and each
step verifies its drafts (k + 1 rows a request); "propose" is the lookup (a part of "update"), the
rejection sampling is in "sample" (in "update" with async scheduling, which samples a verify step when it
finishes it), and a step's tokens (the batch's accepted drafts and one token a request) divide the host
time in the last column. The random weights' greedy outputs soon repeat a token, which the lookup finds
with one token after its latest match: most requests verify one draft a step, and most of those are
accepted (the table's "tokens"; the JSON has each step's drafts). Under speculation a step's host work
lies between two forwards on a GPU too: async scheduling runs a speculating step synchronously.
`--speculative draft`: a draft model of the same shape with `--draft-layers` layers (default 1) and other
random weights, written as a checkpoint directory for the run, proposes k drafts a request; "propose" is
its proposal less its forwards, which count in "forward" (its inputs count in "inputs" too, so "update",
around the proposal, holds them twice and "core_other" comes out low; "host" is exact).

`--async-scheduling both` runs two engines in one process, synchronous and async (`--async-scheduling`),
batch size by batch size, and prints both. With async scheduling a step launches the next step's forward
and sampling, then updates with the step before (the "update" phase includes waiting for its tokens). On
the CPU the forward runs where it is launched, using the thread the host work would need, so there is
nothing to overlap: the comparison shows what async scheduling costs on the host, not what it hides on a
GPU (there, host time overlapped with the device's work leaves the step's critical path).

`--forward replay` runs each batch size's first warm-up decode step for real and then returns its hidden
states and logits instead of running the model: the host phases then find the CPU's caches as a GPU's
forward leaves them. A CPU forward streams every weight through them (the 113 MB float32 lm_head
alone), so with `--forward run` (the default) the host work after it runs from memory; the difference
between the two is what those misses cost. Sampled tokens repeat under replay (the same logits every
step), which changes none of the host's work for greedy requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from safetensors.torch import save_file

from sluice.bench.metrics import percentile
from sluice.benchmarks.engine.phase_clock import ForwardReplay, PhaseClock
from sluice.engine.config import EngineConfig, SpeculativeConfig
from sluice.engine.core import engine_core as engine_core_module
from sluice.engine.frontend.engine import Engine
from sluice.engine.frontend.output_processor import OutputProcessor
from sluice.engine.loading.default_model import default_model_path
from sluice.engine.loading.gguf_loader import load_gguf
from sluice.engine.loading.model_loader import DummyWeights, ModelSource
from sluice.engine.messages import CoreOutputs, decode_core_message, encode
from sluice.engine.process.host_memory import freeze_gc_heap, retain_freed_memory
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.worker import model_runner as model_runner_module

CORE_PHASES = ("schedule", "inputs", "forward", "sample", "update")
NUM_WARMUP_STEPS = 3
TOKEN_BUDGET = 2048
PHASES = (*CORE_PHASES, "core_other", "ipc", "frontend", "detokenize", "propose", "step", "host")
STEP_COUNTS = ("tokens", "drafts", "accepted")


def build_source(num_layers: int, seed: int) -> ModelSource:
    """The embedded model's shape and tokenizer, `num_layers` layers, random weights."""
    embedded = load_gguf(default_model_path())
    arch = replace(embedded.arch, num_hidden_layers=num_layers)
    name = f"{embedded.name} shape, {num_layers} layers, random weights"
    return ModelSource(arch=arch, weights=DummyWeights(arch, seed), tokenizer=embedded.tokenizer, name=name)


def write_draft_checkpoint(directory: str, num_layers: int, seed: int) -> None:
    """A Hugging Face checkpoint of the embedded model's shape with `num_layers` layers and random weights
    (other than the target's: another seed), for `--speculative draft`."""
    embedded = load_gguf(default_model_path()).arch
    arch = replace(embedded, num_hidden_layers=num_layers)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**embedded.extra, "num_hidden_layers": num_layers}, f)
    save_file(
        {name: weight.contiguous() for name, weight in DummyWeights(arch, seed)},
        os.path.join(directory, "model.safetensors"),
    )


def instrument(engine: Engine, clock: PhaseClock, replay: ForwardReplay | None = None) -> None:
    """Wraps the phases of `engine`'s step (instance attributes). Async scheduling: "update" is finishing
    the step in flight (waiting for its tokens, then the update). `replay`: the forward's two calls
    replayed once it is armed."""
    core = engine.core
    if replay is not None:  # inside the clock's wrappers, so "forward" times the replay
        replay.wrap(core.model_runner.graph_runner, "run")
        replay.wrap(core.model_runner.model, "compute_logits")
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.model_runner.graph_runner, "run", "forward")
    clock.wrap(core.model_runner.model, "compute_logits", "forward")
    draft = core.model_runner.draft_runner
    if draft is not None:  # its forwards are device work on a GPU too
        clock.wrap(draft.graph_runner, "run", "forward")
        clock.wrap(draft.model, "compute_logits", "forward")
    clock.wrap(core, "_sample", "sample")
    clock.wrap(core, "_finish_in_flight" if core.config.async_scheduling else "_update", "update")
    clock.wrap(core, "step", "step")
    clock.wrap(engine.output_processor, "process", "frontend")
    if core.speculator.proposer is not None:
        clock.wrap(core.speculator, "propose", "propose")
        if draft is not None:  # the proposal less the draft's forwards, which "forward" counts
            clock.nested("propose", "forward")


def instrument_modules(clock: PhaseClock) -> None:
    """Wraps what every engine shares, once: the input builder, async sampling, detokenization."""
    original_build = model_runner_module.build_model_inputs
    model_runner_module.build_model_inputs = clock.timed("inputs", original_build)
    engine_core_module.launch_sampling = clock.timed("sample", engine_core_module.launch_sampling)
    # Detokenization: OutputProcessor._detokenize of every request (class attribute: states are per request).
    OutputProcessor._detokenize = clock.timed("detokenize", OutputProcessor._detokenize)


def server_step(engine: Engine, clock: PhaseClock) -> tuple[int, int]:
    """One step as a server runs it: core step, CoreOutputs over msgpack, frontend output processing.
    Returns the number of outputs and of tokens in them."""
    core = engine.core
    outputs = core.step()
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    message = decode_core_message(encode(CoreOutputs(outputs, core.stats())))
    clock.wall["ipc"] += time.perf_counter_ns() - wall
    clock.cpu["ipc"] += time.thread_time_ns() - cpu
    processed = engine.output_processor.process(message.outputs)
    core.abort(processed.to_abort)
    return len(processed.outputs), sum(len(o.new_token_ids) for o in message.outputs)


def derived(figures: dict[str, int]) -> dict[str, int]:
    """Adds core_other (step minus its timed phases) and host (step - forward + ipc + frontend)."""
    figures = {phase: figures.get(phase, 0) for phase in PHASES}
    figures["core_other"] = figures["step"] - sum(figures[p] for p in CORE_PHASES)
    figures["host"] = figures["step"] - figures["forward"] + figures["ipc"] + figures["frontend"]
    return figures


GREEDY = SamplingParams(temperature=0.0)


def run_batch(
    engine: Engine,
    clock: PhaseClock,
    batch: int,
    num_steps: int,
    prompt_len: int,
    seed: int,
    replay: ForwardReplay | None = None,
    sampling: SamplingParams = GREEDY,
) -> list[dict[str, Any]]:
    """Prefills `batch` requests, warms up, times `num_steps` decode steps of all of them (`replay`: armed
    from the first warm-up step on). `sampling`: the requests' temperature, top_p, top_k (greedy). Each
    step's figures: its phases' wall and CPU nanoseconds, the tokens it gave, the drafts it verified and
    accepted."""
    rng = random.Random(seed + batch)
    vocab = engine.model_info.vocab_size
    max_tokens = max_output_len(batch, num_steps, prompt_len, tokens_per_step(engine))
    params = dataclasses.replace(sampling, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(3, vocab) for _ in range(prompt_len)], params)
    scheduler = engine.core.scheduler
    while scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens - 1 for r in map(scheduler.get_request, ids)
    ):
        server_step(engine, clock)  # prefill
    if replay is not None:
        replay.arm()
    for _ in range(NUM_WARMUP_STEPS):
        server_step(engine, clock)
    steps = []
    for _ in range(num_steps):
        clock.reset()
        counters = engine.core.speculator.counters
        drafts, accepted = counters.num_draft_tokens, counters.num_accepted
        num_outputs, num_tokens = server_step(engine, clock)
        if num_outputs != batch:
            raise RuntimeError(f"a decode step of {batch} requests gave {num_outputs} outputs")
        figures = {"wall": derived(clock.wall), "cpu": derived(clock.cpu), "tokens": num_tokens}
        figures["drafts"] = counters.num_draft_tokens - drafts
        figures["accepted"] = counters.num_accepted - accepted
        steps.append(figures)
    if replay is not None:
        replay.disarm()
    engine.abort(ids)
    return steps


def tokens_per_step(engine: Engine) -> int:
    """The most tokens a request gets in one step: 1, or k + 1 when it verifies k drafts."""
    return 1 + engine.model_info.num_speculative_tokens


def max_output_len(batch: int, num_steps: int, prompt_len: int, per_step: int = 1) -> int:
    """Outputs the first request admitted may reach: up to `per_step` per prefill step, warm-up and timed
    step."""
    num_prefill_steps = -(-batch * prompt_len // TOKEN_BUDGET) + 1
    return (num_prefill_steps + NUM_WARMUP_STEPS + num_steps + 1) * per_step


def quantile(values: list[int], q: float) -> float:
    """The q-quantile, interpolated as `sluice bench` reports its percentiles (numpy's default)."""
    return percentile(values, 100 * q)


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per phase (microseconds), host p90, wall and thread CPU; tokens, drafts verified and
    accepted a step (means)."""
    summary: dict[str, Any] = {key: statistics.fmean(s[key] for s in steps) for key in STEP_COUNTS}
    for clock in ("wall", "cpu"):
        by_phase = {p: [s[clock][p] for s in steps] for p in PHASES}
        summary[clock] = {p: statistics.median(v) / 1000 for p, v in by_phase.items()}
        summary[clock]["host_p90"] = quantile(by_phase["host"], 0.9) / 1000
    return summary


def format_table(results: dict[int, dict[str, Any]], mode: str = "sync") -> str:
    columns = [*CORE_PHASES, "core_other", "ipc", "frontend", "detokenize", "propose", "step", "host"]
    lines = [
        "| batch | scheduling | clock | " + " | ".join(columns) + " | host p90 | tokens | host / token |",
        "| ---: | --- | --- |" + " ---: |" * (len(columns) + 3),
    ]
    for batch, summary in results.items():
        for clock in ("wall", "cpu"):
            s = summary[clock]
            cells = " | ".join(f"{s[c]:.0f}" for c in columns)
            tokens = summary["tokens"]
            lines.append(
                f"| {batch} | {mode} | {clock} | {cells} | {s['host_p90']:.0f} | {tokens:.1f}"
                f" | {s['host'] / tokens:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.engine.host_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per batch size")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument(
        "--num-threads", type=int, default=1, help="torch threads (1: no OpenMP waits on a busy machine)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every step's figures here")
    parser.add_argument(
        "--async-scheduling",
        choices=("off", "on", "both"),
        default="off",
        help="the engine's scheduling: synchronous (off), async (on), or both in one run",
    )
    parser.add_argument(
        "--forward",
        choices=("run", "replay"),
        default="run",
        help="run the model every step, or replay the first decode step's hidden states and logits",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests' (0: greedy)")
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="random weights' logits are flat: a nucleus is most of the vocab",
    )
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument(
        "--speculative",
        choices=("off", "ngram", "draft"),
        default="off",
        help="every step verifies drafts: by prompt lookup or a random draft model (with --forward run only)",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="k, with --speculative")
    parser.add_argument("--draft-layers", type=int, default=1, help="the draft model's, --speculative draft")
    args = parser.parse_args(argv)
    if args.speculative != "off" and args.forward == "replay":
        parser.error("--speculative: a verify step's logits have a row a draft, so its forward must run")
    drafting = args.speculative == "draft"
    with tempfile.TemporaryDirectory(prefix="sluice-draft-") if drafting else nullcontext() as draft_dir:
        speculative = None
        if args.speculative != "off":
            speculative = SpeculativeConfig(
                method=args.speculative,
                num_speculative_tokens=args.num_speculative_tokens,
                draft_model=draft_dir,
            )
        if drafting:
            write_draft_checkpoint(draft_dir, args.draft_layers, args.seed + 1)
        run(args, speculative)


def run(args: argparse.Namespace, speculative: SpeculativeConfig | None) -> None:
    """The timed batches and their tables, as `main` parsed them."""
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    per_step = 1 if speculative is None else 1 + speculative.num_speculative_tokens

    torch.set_num_threads(args.num_threads)
    max_batch = max(args.batch)
    max_len = args.prompt_len + max_output_len(max_batch, args.steps, args.prompt_len, per_step)
    num_blocks = max_batch * (-(-max_len // 16) + 1) + 16
    modes = {"off": ["sync"], "on": ["async"], "both": ["sync", "async"]}[args.async_scheduling]
    clock = PhaseClock()
    instrument_modules(clock)
    engines = {}
    replay = ForwardReplay() if args.forward == "replay" else None
    for mode in modes:
        config = EngineConfig.from_kwargs(
            max_num_seqs=max_batch,
            max_num_batched_tokens=max(TOKEN_BUDGET, max_batch),
            num_blocks=num_blocks,
            async_scheduling=mode == "async",
            speculative=speculative,
        )
        engines[mode] = Engine(config, build_source(args.num_layers, args.seed))
        instrument(engines[mode], clock, replay)
    retain_freed_memory()  # as the engine core process does, once loaded
    freeze_gc_heap()
    results: dict[str, dict[int, Any]] = {mode: {} for mode in modes}
    raw: dict[str, dict[int, Any]] = {mode: {} for mode in modes}
    for batch in args.batch:  # the modes alternate batch by batch, so a machine's drift touches both
        for mode, engine in engines.items():
            steps = run_batch(engine, clock, batch, args.steps, args.prompt_len, args.seed, replay, sampling)
            results[mode][batch] = summarize(steps)
            raw[mode][batch] = steps
            print("\n".join(format_table({batch: results[mode][batch]}, mode).splitlines()[-2:]), flush=True)
    name = next(iter(engines.values())).model_info.name
    forward = "replayed (no forward)" if replay is not None else "run"
    drawn = "greedy" if sampling.greedy else f"temperature {sampling.temperature}, top_p {sampling.top_p}"
    drawn += f", top_k {sampling.top_k}" if sampling.top_k else ""
    if speculative is not None:
        drawn += f"; {speculative.method} drafts, k = {speculative.num_speculative_tokens}"
        drawn += f" ({args.draft_layers}-layer draft model)" if speculative.method == "draft" else ""
    print(f"\nmodel: {name}; forward {forward}; {drawn}; microseconds per decode step", end="")
    print(f", medians over {args.steps}\n")
    for mode in modes:
        print(format_table(results[mode], mode))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "summary": results, "steps": raw}, f, indent=1)


if __name__ == "__main__":
    main()
