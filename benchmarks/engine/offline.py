"""Offline engine benchmark against `transformers.generate` on the same weights and workload.

    # throughput: 64 mixed-length requests, 128 out
    python -m sluice.benchmarks.engine.offline
    # prefix caching on vs off on a shared system prompt
    python -m sluice.benchmarks.engine.offline --workload agent
    # on a GPU
    python -m sluice.benchmarks.engine.offline --device cuda --dtype bfloat16 --preset llama-3.2-1b

Builds a random-weight checkpoint of a preset's shape with `transformers` (so both sides run the very
same weights), then prints a table of ratios and writes JSON with --json. Each Sluice run is a fresh
engine warmed up on a prompt of its own; the table gives the prompt tokens it served from its prefix
cache (only the agent workload's shared system prompt may be) and flags a run that was served more.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sluice.bench.metrics import percentile
from sluice.benchmarks.engine.cache_hits import CacheHits
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.presets import PRESETS
from sluice.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Result:
    name: str
    seconds: float
    output_tokens: int
    ttft_mean: float | None = None
    ttft_p90: float | None = None
    cached_tokens: int | None = None  # Sluice: prompt tokens served from the prefix cache
    prompt_tokens_computed: int | None = None
    cache_hits_unexpected: bool = False  # beyond the prefix all the run's prompts share

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def build_checkpoint(
    preset: str, directory: str, seed: int, dtype: str = "float32", device: str = "cpu"
) -> torch.nn.Module:
    """Saves a random-weight transformers model of the preset's shape in `dtype`; returns it (eval)
    on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(PRESETS[preset])
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
    config = AutoConfig.for_model(model_type[fields["architectures"][0]], **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    model.save_pretrained(directory)
    return model.to(device)


def mixed_workload(num_requests: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, vocab_size) for _ in range(n)]
    return [tokens(rng.randint(32, 512)) for _ in range(num_requests)]


def agent_workload(num_requests: int, vocab_size: int, seed: int, system_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, vocab_size) for _ in range(n)]
    system = tokens(system_len)
    return [system + tokens(rng.randint(32, 128)) for _ in range(num_requests)]


def run_sluice(name: str, directory: str, prompts: list[list[int]], output_len: int, **engine_args) -> Result:
    llm = LLM(directory, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    warmup = warmup_prompt(llm.engine.model_info.vocab_size)
    llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=2))
    start = time.perf_counter()
    completions = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    ttfts = sorted(c.timings.ttft_seconds for c in completions)
    hits = CacheHits.of(completions)
    return Result(
        name,
        seconds,
        sum(len(c.token_ids) for c in completions),
        ttft_mean=statistics.fmean(ttfts),
        ttft_p90=percentile(ttfts, 90),  # interpolated, as `sluice bench` reports its percentiles
        cached_tokens=hits.cached_tokens,
        prompt_tokens_computed=hits.computed_tokens,
        cache_hits_unexpected=hits.unexpected,
    )


def warmup_prompt(vocab_size: int, num_tokens: int = 32) -> list[int]:
    """Random tokens from a stream of their own: no prefix of a measured prompt, so the warm-up leaves
    nothing in the prefix cache that a measured request could use."""
    rng = random.Random("offline warm-up")
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]


def run_hf_sequential(model: torch.nn.Module, prompts: list[list[int]], output_len: int) -> Result:
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    _synchronize(model.device)
    return Result("transformers sequential", time.perf_counter() - start, len(prompts) * output_len)


def run_hf_static_batches(
    model: torch.nn.Module, prompts: list[list[int]], output_len: int, batch_size: int
) -> Result:
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)  # left pad
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
    _synchronize(model.device)
    name = f"transformers static batch {batch_size}"
    return Result(name, time.perf_counter() - start, len(prompts) * output_len)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_table(title: str, results: list[Result], reference: Result) -> None:
    print(f"\n{title}")
    print(f"{'run':<34}{'seconds':>9}{'tok/s':>10}{'ratio':>8}{'TTFT mean':>11}{'TTFT p90':>10}{'cached':>9}")
    for r in results:
        ttft = f"{'-':>11}{'-':>10}" if r.ttft_mean is None else f"{r.ttft_mean:>11.3f}{r.ttft_p90:>10.3f}"
        ratio = r.tokens_per_second / reference.tokens_per_second
        flag = "!" if r.cache_hits_unexpected else ""
        cached = "-" if r.cached_tokens is None else f"{r.cached_tokens}{flag}"
        print(f"{r.name:<34}{r.seconds:>9.2f}{r.tokens_per_second:>10.1f}{ratio:>7.2f}x{ttft}{cached:>9}")
    for r in results:
        if r.cache_hits_unexpected:
            print(f"warning: {r.name}: prompts hit the prefix cache beyond the prefix they share by design")


def throughput(args: argparse.Namespace, directory: str, model: torch.nn.Module) -> list[Result]:
    prompts = mixed_workload(args.num_requests, model.config.vocab_size, args.seed)
    sluice = run_sluice(
        "sluice", directory, prompts, args.output_len, max_num_batched_tokens=1024, **_placement(args)
    )
    runs: list[Callable[[], Result]] = [
        lambda: run_hf_sequential(model, prompts, args.output_len),
        lambda: run_hf_static_batches(model, prompts, args.output_len, 8),
    ]
    results = [sluice] + [run() for run in runs]
    print_table("Throughput (output tokens/s; ratio vs transformers sequential)", results, results[1])
    return results


def agent(args: argparse.Namespace, directory: str, model: torch.nn.Module) -> list[Result]:
    prompts = agent_workload(args.num_requests, model.config.vocab_size, args.seed, args.system_len)
    results = [
        run_sluice(name, directory, prompts, args.output_len, enable_prefix_caching=on, **_placement(args))
        for name, on in (("sluice prefix caching on", True), ("sluice prefix caching off", False))
    ]
    print_table("Agent workload (shared system prompt; ratio vs caching off)", results, results[1])
    on, off = results
    mean_ratio, p90_ratio = off.ttft_mean / on.ttft_mean, off.ttft_p90 / on.ttft_p90
    print(f"TTFT mean off/on: {mean_ratio:.2f}x   p90 off/on: {p90_ratio:.2f}x")
    return results


def _placement(args: argparse.Namespace) -> dict[str, str]:
    return {"device": args.device, "dtype": args.dtype}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.engine.offline", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--workload", choices=("throughput", "agent"), default="throughput")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both sides of the comparison)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        model = build_checkpoint(args.preset, directory, args.seed, args.dtype, args.device)
        results = (throughput if args.workload == "throughput" else agent)(args, directory, model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ | {"tokens_per_second": r.tokens_per_second} for r in results], f, indent=2)


if __name__ == "__main__":
    main()
