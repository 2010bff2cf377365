"""The C++ decoder stack's step as one team of threads against one parallel region per kernel, same process.

    python -m sluice.benchmarks.engine.cpu_team [--batch 1 16] [--rounds 10] [--json out.json]

The offline `LLM` on the embedded SmolLM2-135M (or --model), greedy, `ignore_eos`, seeded 64-token prompts
and 32 output tokens. For each batch size, each round makes two `generate` calls of that many fresh prompts
(no prefix-cache hits), one with the stack's team (kernels/cpu_team.h, the default) and one with a parallel
region per kernel (`LlamaCpuStack.team = False`, the stack before the team), their order swapped every other
round, so a machine whose speed drifts favours neither. It prints each side's output tokens/s (medians), the
median of the rounds' ratios, and the voluntary context switches of this process per output token (a thread
that sleeps waiting for another: what the team's spinning barrier saves).

The process runs with the engine core's OpenMP settings (GOMP_SPINCOUNT=1000, `core_process_environment`:
it re-executes itself with them unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is already set), since the core
process is where the stack runs when Sluice serves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from sluice.engine.process.threads import core_process_environment

SIDES = ("team", "region per kernel")


def voluntary_switches() -> int:
    """Voluntary context switches of every thread of this process so far."""
    total = 0
    for status in Path("/proc/self/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def run_side(llm, stack, team: bool, prompts: list[list[int]], params) -> dict[str, float]:
    stack.team = team
    switches, start = voluntary_switches(), time.perf_counter()
    completions = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in completions)
    cached = sum(c.cached_tokens for c in completions)
    if cached:
        raise RuntimeError(f"{cached} prompt tokens came from the prefix cache: the prompts repeated")
    return {
        "tokens_per_second": tokens / seconds,
        "switches_per_token": (voluntary_switches() - switches) / tokens,
    }


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def format_table(results: dict[int, dict[str, list[dict[str, float]]]]) -> str:
    lines = [
        "| batch | rounds | team tok/s | region per kernel tok/s | team / regions (median) | min | max "
        "| sleeps per token: team / regions |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for batch, sides in results.items():
        team, regions = sides["team"], sides["region per kernel"]
        ratios = [t["tokens_per_second"] / r["tokens_per_second"] for t, r in zip(team, regions, strict=True)]
        lines.append(
            f"| {batch} | {len(ratios)} | {_median(team, 'tokens_per_second'):.1f} | "
            f"{_median(regions, 'tokens_per_second'):.1f} | {statistics.median(ratios):.3f} | "
            f"{min(ratios):.3f} | {max(ratios):.3f} | {_median(team, 'switches_per_token'):.2f} / "
            f"{_median(regions, 'switches_per_token'):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.engine.cpu_team", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    import torch

    from sluice.bench.workloads import Workload
    from sluice.engine.frontend.llm import LLM
    from sluice.engine.sampling_params import SamplingParams

    llm = LLM(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    stack = llm.engine.model_runner.cpu_stack
    if stack is None:
        raise SystemExit("this model does not run on the C++ decoder stack (see the log for why)")
    workload = Workload(
        "fixed", llm.engine.model_info.vocab_size, input_len=args.input_len, output_len=args.output_len
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([list(workload.warmup_request(0).prompt_token_ids)], params)
    results: dict[int, dict[str, list[dict[str, float]]]] = {}
    for batch in args.batch:
        results[batch] = {side: [] for side in SIDES}
        for round_index in range(args.rounds):
            run = workload.for_run(len(args.batch) * round_index + args.batch.index(batch))
            prompts = [list(r.prompt_token_ids) for r in run.requests(2 * batch)]
            order = SIDES if round_index % 2 == 0 else SIDES[::-1]
            for position, side in enumerate(order):
                chunk = prompts[position * batch : (position + 1) * batch]
                results[batch][side].append(run_side(llm, stack, side == "team", chunk, params))
        print(format_table({batch: results[batch]}).splitlines()[-1], flush=True)
    stack.team = True
    print(
        f"\nmodel: {llm.engine.model_info.name}; {args.input_len}-token prompts, {args.output_len} out; "
        f"{torch.get_num_threads()} threads; GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}\n"
    )
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(batch): sides for batch, sides in results.items()}, f, indent=2)


if __name__ == "__main__":
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.execve(
            sys.executable,
            [sys.executable, "-m", __spec__.name, *sys.argv[1:]],
            core_process_environment(os.environ),
        )
    main()
