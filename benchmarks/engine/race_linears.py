"""The CPU race's workload (sluice.benchmarks.engine.cpu_race), its fp32 linears alone: how fast could an
engine run it on this machine if attention, norms, sampling and the rest cost nothing? Sluice's packed-panel
kernel (kernels/cpu_packed_linear.h) against numpy's BLAS (OpenBLAS in its wheels), each library in its own
process (OpenBLAS's threads busy-wait after a call and would slow the other), taking turns.

    # 64 requests, as the race's 64 x 64
    python -m sluice.benchmarks.engine.race_linears --rounds 3

The workload is shaped like Sluice's schedule of it, with the same FLOPs: the requests' prompt tokens in
steps of up to `--token-budget` rows through every layer's linears (qkv, o, gate_up, down) and lm_head for
the rows of requests whose prompt ends in that step, then max_tokens - 1 decode steps of one row a request
through the layers and lm_head (sluice.benchmarks.engine.machine_limits.linear_flops_per_request counts the
same). The weights are random, of the embedded SmolLM2-135M's shapes, a set per layer as in the model (they do
not fit in the caches); lm_head is the vocabulary's [vocab, hidden].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from sluice.engine.loading.default_model import default_model_path
from sluice.engine.loading.gguf_loader import load_gguf
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.process.threads import configure_torch_threads, physical_cores_available
from sluice.kernels.cpu_packed_linear import pack_weight, packed_linear

LIBRARIES = ("sluice packed", "numpy")
Matmul = Callable[[torch.Tensor], object]  # x [rows, in] -> x @ W^T, [rows, out]


def layer_shapes(arch: ModelArchConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's fused linears: qkv, o, gate_up, down."""
    hidden, heads = arch.hidden_size, arch.num_attention_heads
    qkv = (heads + 2 * arch.num_key_value_heads) * arch.head_dim
    return [(qkv, hidden), (hidden, heads * arch.head_dim), (2 * arch.intermediate_size, hidden),
            (hidden, arch.intermediate_size)]  # fmt: skip


def schedule(concurrency: int, prompt_len: int, max_tokens: int, token_budget: int) -> list[tuple[int, int]]:
    """(rows through the layers, rows through lm_head) of each step: prefill chunks, then decode steps."""
    total = concurrency * prompt_len
    prompt_ends = [(i + 1) * prompt_len - 1 for i in range(concurrency)]  # a request's last prompt row
    steps = []
    for start in range(0, total, token_budget):
        end = min(start + token_budget, total)
        steps.append((end - start, sum(start <= row < end for row in prompt_ends)))
    return steps + [(concurrency, concurrency)] * (max_tokens - 1)


def step_flops(arch: ModelArchConfig, steps: list[tuple[int, int]]) -> int:
    per_row = arch.num_hidden_layers * sum(out * inp for out, inp in layer_shapes(arch))
    return 2 * sum(
        rows * per_row + head_rows * arch.vocab_size * arch.hidden_size for rows, head_rows in steps
    )


def make_matmul(library: str, weight: torch.Tensor) -> Matmul:
    """x -> x @ weight^T in `library`, the weight laid out once for it."""
    if library == "sluice packed":
        packed, out = pack_weight(weight), weight.shape[0]
        return lambda x: packed_linear(x, packed, out)
    weight_t = weight.t().contiguous().numpy()
    return lambda x: x.numpy() @ weight_t


def run_library(library: str, arch: ModelArchConfig, steps: list[tuple[int, int]]) -> list[float]:
    """Seconds of each step's linears in `library`."""
    generator = torch.Generator().manual_seed(0)
    shapes = layer_shapes(arch)

    def matmul(out: int, inp: int) -> Matmul:
        return make_matmul(library, torch.randn(out, inp, generator=generator) / inp**0.5)

    layers = [[matmul(*shape) for shape in shapes] for _ in range(arch.num_hidden_layers)]
    lm_head = matmul(arch.vocab_size, arch.hidden_size)
    max_rows = max(rows for rows, _ in steps)
    inputs = {inp: torch.randn(max_rows, inp, generator=generator) for _, inp in shapes}

    def step(rows: int, head_rows: int) -> None:
        for layer in layers:
            for linear, (_, inp) in zip(layer, shapes, strict=True):
                linear(inputs[inp][:rows])
        if head_rows:
            lm_head(inputs[arch.hidden_size][:head_rows])

    step(*steps[-1])  # warm-up: a BLAS's first call sets itself up
    seconds = []
    for rows, head_rows in steps:
        start = time.perf_counter()
        step(rows, head_rows)
        seconds.append(time.perf_counter() - start)
    return seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.engine.race_linears", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--token-budget", type=int, default=2048, help="rows of a prefill step (the engine's)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch and BLAS threads (default: physical cores)")
    parser.add_argument("--library", choices=LIBRARIES, help=argparse.SUPPRESS)  # one process's part
    args = parser.parse_args(argv)
    for name in ("concurrency", "prompt_len", "max_tokens", "token_budget", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    arch = load_gguf(default_model_path()).arch
    steps = schedule(args.concurrency, args.prompt_len, args.max_tokens, args.token_budget)
    if args.library:  # a child process: one library, one JSON line
        configure_torch_threads(args.threads)
        print(json.dumps(run_library(args.library, arch, steps)))
        return
    module = "sluice.benchmarks.engine.race_linears"
    child = [sys.executable, "-m", module, *(argv if argv is not None else sys.argv[1:])]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(args.threads or physical_cores_available())}
    seconds: dict[str, list[list[float]]] = {library: [] for library in LIBRARIES}
    for round_index in range(args.rounds):
        for library in LIBRARIES if round_index % 2 == 0 else LIBRARIES[::-1]:
            done = subprocess.run([*child, "--library", library], capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise SystemExit(f"{library}: run failed: {done.stderr.strip().splitlines()[-1:]}")
            seconds[library].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print_report(args, arch, steps, seconds)


def print_report(
    args: argparse.Namespace, arch: ModelArchConfig, steps: list[tuple[int, int]], seconds: dict[str, list]
) -> None:
    """Per library, the median over rounds (and range) of the prefill's, the decode's and the whole run's
    seconds, their GFLOP/s, and the tok/s the linears alone would allow."""
    prefill = len(steps) - (args.max_tokens - 1)
    parts = {"prefill": slice(0, prefill), "decode": slice(prefill, None), "all": slice(None)}
    tokens = args.concurrency * args.max_tokens
    print(
        f"{arch.name}: {args.concurrency} requests x ({args.prompt_len} prompt + {args.max_tokens} output) "
        f"tokens, linears only: {len(steps)} steps ({prefill} prefill of <= {args.token_budget} rows), "
        f"{step_flops(arch, steps) / 1e9:.0f} GFLOP; {args.rounds} rounds, medians (range)"
    )
    for library, runs in seconds.items():
        cells = []
        for part, steps_of_part in parts.items():
            totals = [sum(run[steps_of_part]) for run in runs]
            median = statistics.median(totals)
            cells.append(
                f"{part} {median:.2f} s ({min(totals):.2f}-{max(totals):.2f}), "
                f"{step_flops(arch, steps[steps_of_part]) / median / 1e9:.0f} GFLOP/s"
            )
        best = min(sum(run) for run in runs)
        cells.append(f"-> at most {tokens / best:.0f} tok/s (best round)")
        print(f"{library:<14}" + "; ".join(cells))


if __name__ == "__main__":
    main()
