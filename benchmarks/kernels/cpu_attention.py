"""Offline decode throughput on CPU, C++ attention backend ("cpu") against the torch one, in one run.

    python -m sluice.benchmarks.kernels.cpu_attention                      # the embedded SmolLM2-135M, fp32
    python -m sluice.benchmarks.kernels.cpu_attention --batches 1 16 64 --repeats 3 --json cpu_attention.json

Each batch size runs `batch` requests of `--prompt-len` random tokens for `--output-len` greedy tokens
(ignore_eos) through `LLM.generate`, the backends alternating within each repeat so machine noise falls
on both. Attention time is the backends' `forward` (K/V write + attention, all layers) summed over the
pure-decode steps and divided by their number ("-" where no decode step called it: the C++ backend's
decoder stack runs every layer in one C++ call, attention included). Prints min-max over the repeats and
writes JSON with --json.

Every (repeat, batch) draws new prompts (both backends the same ones: each has its own engine) and the
warm-up its own, so no prefill is served from the prefix cache (a run's JSON has cached_tokens: 0; a
warning names a run that is not).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.worker.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class Run:
    backend: str
    batch: int
    seconds: float
    output_tokens: int
    decode_steps: int
    attention_ms_per_decode_step: float | None  # None: no pure-decode step went through `forward`
    cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


class TimedBackend:
    """Wraps an attention backend; sums the wall time of its pure-decode calls."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.name = backend.name
        self.decode_seconds = 0.0
        self.decode_calls = 0

    def forward(
        self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float, **kwargs
    ) -> torch.Tensor:
        if not metadata.is_pure_decode:
            return self.backend.forward(q, k, v, k_cache, v_cache, metadata, scale, **kwargs)
        start = time.perf_counter()
        out = self.backend.forward(q, k, v, k_cache, v_cache, metadata, scale, **kwargs)
        self.decode_seconds += time.perf_counter() - start
        self.decode_calls += 1
        return out


def load(backend: str, model: str | None) -> tuple[LLM, TimedBackend]:
    llm = LLM(model, attention_backend=backend, max_num_seqs=128)
    runner = llm.engine.model_runner
    assert runner.attention_backend.name == backend, runner.attention_backend.name
    timed = TimedBackend(runner.attention_backend)
    for layer in runner.model.model.layers:
        layer.self_attn.attn.backend = timed  # the layer's Attention module calls its backend
    return llm, timed


def run_batch(llm: LLM, timed: TimedBackend, prompts: list[list[int]], output_len: int) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    num_layers = len(llm.engine.model_runner.model.model.layers)
    timed.decode_seconds, timed.decode_calls = 0.0, 0
    start = time.perf_counter()
    completions = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    steps = timed.decode_calls // num_layers
    return Run(
        timed.name,
        len(prompts),
        seconds,
        sum(len(c.token_ids) for c in completions),
        steps,
        1000 * timed.decode_seconds / steps if steps else None,
        sum(c.cached_tokens for c in completions),
    )


def make_prompts(count: int, prompt_len: int, vocab_size: int, seed: str) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(count)]


def greedy_tokens(llm: LLM, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    return [c.token_ids for c in llm.generate(prompts, params)]


def print_table(runs: list[Run], backends: list[str], batches: list[int]) -> None:
    print(f"\n{'backend':<8}{'batch':>6}{'tok/s (min-max)':>20}{'attn ms/decode step':>24}{'speedup':>10}")
    for batch in batches:
        rows = {b: [r for r in runs if r.backend == b and r.batch == batch] for b in backends}
        tps = {b: sorted(r.tokens_per_second for r in rows[b]) for b in backends}
        baseline = _median(tps[backends[-1]])
        for backend in backends:
            timed = sorted(
                r.attention_ms_per_decode_step for r in rows[backend] if r.attention_ms_per_decode_step
            )
            attn = f"{timed[0]:.1f}-{timed[-1]:.1f}" if timed else "-"
            print(
                f"{backend:<8}{batch:>6}{f'{tps[backend][0]:.1f}-{tps[backend][-1]:.1f}':>20}"
                f"{attn:>24}{_median(tps[backend]) / baseline:>9.2f}x"
            )


def _median(values: list[float]) -> float:
    return values[len(values) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.kernels.cpu_attention", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--backends", nargs="+", default=["cpu", "torch"], help="the last is the baseline")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every run to this file")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, intra-op threads {torch.get_num_threads()}, "
          f"inter-op threads {torch.get_num_interop_threads()}")  # fmt: skip
    engines = {backend: load(backend, args.model) for backend in args.backends}
    vocab = engines[args.backends[0]][0].engine.model_runner.arch.vocab_size
    warm = make_prompts(4, args.prompt_len, vocab, f"{args.seed} warm-up")
    check = {b: greedy_tokens(llm, warm, 16) for b, (llm, _) in engines.items()}  # also a warm-up
    agree = all(check[b] == check[args.backends[-1]] for b in args.backends)
    print(f"greedy tokens (4 prompts x 16) equal across backends: {agree}")
    runs = []
    for repeat in range(args.repeats):
        for batch in args.batches:
            seed = f"{args.seed} repeat {repeat} batch {batch}"
            prompts = make_prompts(batch, args.prompt_len, vocab, seed)
            for llm, timed in engines.values():
                run = run_batch(llm, timed, prompts, args.output_len)
                runs.append(run)
                attention = run.attention_ms_per_decode_step
                attention_text = "-" if attention is None else f"{attention:.1f}"
                print(
                    f"  {run.backend} batch {run.batch}: {run.tokens_per_second:.1f} tok/s, "
                    f"{attention_text} ms attention per decode step, {run.cached_tokens} tokens cached",
                    flush=True,
                )
    print_table(runs, args.backends, args.batches)
    for run in runs:
        if run.cached_tokens:
            print(f"warning: {run.backend} batch {run.batch}: {run.cached_tokens} prompt tokens cached")
    print("(2-core machine shared with others: figures are noisy; min-max over repeats, speedup of medians)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"tokens_per_second": r.tokens_per_second} for r in runs], f, indent=2)


if __name__ == "__main__":
    main()
