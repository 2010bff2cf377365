"""Tensor parallelism on CPU: one rank with T torch threads against T ranks of 1 thread each (gloo between
processes), and one rank of 1 thread for scale, the same model and greedy workload, run one after the
other on one machine.

    python -m sluice.benchmarks.engine.tensor_parallel                     # the embedded SmolLM2-135M
    python -m sluice.benchmarks.engine.tensor_parallel --model gemma3-270m --json tp.json

SmolLM2-135M has 9 query heads and 3 KV heads: 2 ranks cannot split it (the engine refuses, naming
`tensor_parallel_size`), which the table then says; Gemma 3 270M (4 query heads, 1 KV head, replicated)
splits over 2. Workloads, each after a warm-up on an engine of its own: one request decoding (ms per output
token after the first, and time to the first token of a 256-token prompt), and 16 requests at once (output
tokens per second). Tokens are compared with the first run's. The load average is printed before and
after: on a machine whose cores other processes also use, a T-thread OpenMP pool waits at every op for
its slowest thread, which separate 1-thread ranks do not (they wait at the all-reduces instead), so a
busy machine favours the ranks; compare runs made on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Result:
    ranks: int
    threads_per_rank: int
    decode_ms_per_token: float | None = None
    ttft_ms: float | None = None
    batch_tokens_per_second: float | None = None
    same_tokens_as_one_rank: bool | None = None
    refused: str | None = None


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, min(vocab, 30000)) for _ in range(length)] for _ in range(count)]


def _engine(model: str | None, ranks: int, threads: int, max_model_len: int) -> LLM:
    common = dict(max_model_len=max_model_len, max_num_seqs=16, kv_cache_memory_bytes=256 << 20)
    if ranks == 1:
        torch.set_num_threads(threads)  # an offline engine runs in this process, on its threads
        return LLM(model, **common)
    return LLM(model, tensor_parallel_size=ranks, num_threads=threads, **common)


def measure(model: str | None, ranks: int, threads: int, args: argparse.Namespace) -> tuple[Result, list]:
    """One engine: warm-up, one decoding request, then a batch of 16. Returns the result and the tokens."""
    try:
        llm = _engine(model, ranks, threads, args.max_model_len)
    except ValueError as refused:
        return Result(ranks, threads, refused=str(refused)), []
    try:
        vocab = llm.engine.model_info.vocab_size
        greedy = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        llm.generate(_prompts(1, 16, vocab, seed=1), SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        (single,) = llm.generate(_prompts(1, args.prompt_tokens, vocab, seed=2), greedy)
        t = single.timings
        decode_ms = (t.finished - t.first_token) / (len(single.token_ids) - 1) * 1e3
        batch_params = SamplingParams(temperature=0.0, max_tokens=args.batch_tokens, ignore_eos=True)
        start = time.perf_counter()
        batch = llm.generate(_prompts(16, 32, vocab, seed=3), batch_params)
        seconds = time.perf_counter() - start
    finally:
        if ranks > 1:
            llm.engine.model_runner.shutdown()
    tokens = [single.token_ids] + [c.token_ids for c in batch]
    output_tokens = sum(len(c.token_ids) for c in batch)
    result = Result(ranks, threads, decode_ms, (t.first_token - t.arrival) * 1e3, output_tokens / seconds)
    return result, tokens


def table(rows: Sequence[Result]) -> str:
    lines = [
        "| ranks x threads | decode ms/token | TTFT ms | batch 16 tok/s | same tokens as the first row |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        name = f"{r.ranks} x {r.threads_per_rank}"
        if r.refused:
            lines.append(f"| {name} | refused: {r.refused} | | | |")
            continue
        same = "-" if r.same_tokens_as_one_rank is None else ("yes" if r.same_tokens_as_one_rank else "no")
        lines.append(
            f"| {name} | {r.decode_ms_per_token:.1f} | {r.ttft_ms:.0f} | {r.batch_tokens_per_second:.1f} "
            f"| {same} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="as sluice serve --model (default: the embedded SmolLM2)"
    )
    parser.add_argument("--threads", type=int, default=2, help="T: one rank of T threads vs T ranks of 1")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    one, reference = measure(args.model, 1, args.threads, args)
    results = [one]
    for ranks, threads in ((1, 1), (args.threads, 1)):
        result, tokens = measure(args.model, ranks, threads, args)
        if result.refused is None:
            result = Result(**{**asdict(result), "same_tokens_as_one_rank": tokens == reference})
        results.append(result)
    load = f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"model: {args.model or 'embedded SmolLM2-135M'}, float32 on CPU, {os.cpu_count()} CPUs, {load}\n")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model": args.model, "load": load, "results": [asdict(r) for r in results]}, f, indent=2
            )


if __name__ == "__main__":
    main()
