"""CPU race on the embedded SmolLM2-135M: Sluice's offline `LLM` against `transformers.generate` (static
batches) and llama.cpp (llama-cpp-python, batched sequences) on the same GGUF, in one run.

    python -m sluice.bench.cpu_race                                  # 1, 16, 64 concurrent requests
    python -m sluice.bench.cpu_race --llamacpp-python /work/llamacpp-venv/bin/python --json race.json
    python -m sluice.bench.cpu_race --quantization int4              # adds a Sluice int4 column

Every engine gets the same random 64-token prompts and decodes 64 greedy tokens each (no EOS stop); a
run's tok/s is its output tokens over its wall time, prefill included. For Sluice the run also gives its
decode rate: the tokens after each request's first over the time from the first first token to the last
finish, which at batch 1 is the steady decode step the bandwidth floor describes (no prefill in it).
Sluice and transformers run in float32 on the GGUF's dequantized weights; llama.cpp runs the Q4_1 file
as is. llama.cpp needs llama-cpp-python, which builds from source, so it lives in its own environment
(`--llamacpp-python`); without one, its column says why. The machine's limits are measured first: read
bandwidth (a sum over a tensor far larger than the caches), the fp32 GEMM rate, and the batch-1 floor
they imply for Sluice's fp32 weights (every weight read once per step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.core.host_memory import freeze_gc_heap, retain_freed_memory
from engine.core.threads import configure_torch_threads
from engine.frontend.llm import LLM
from engine.loading.default_model import default_model_path
from engine.sampling_params import SamplingParams

RUNNER = Path(__file__).with_name("llamacpp_runner.py")


@dataclass(frozen=True)
class Row:
    engine: str
    concurrency: int
    tokens_per_second: float | None
    note: str = ""
    decode_tokens_per_second: float | None = None  # Sluice only: after the first token, see above


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Best of `repeats` sums over a float32 tensor of `megabytes` (GB/s read)."""
    x = torch.ones(megabytes * 2**20 // 4)
    best = min(_seconds(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def gemm_gflops(size: int = 2048, repeats: int = 5) -> float:
    """Best of `repeats` float32 [size, size] x [size, size] matmuls (GFLOP/s)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up: MKL's first call sets itself up
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_prompts(count: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(count)]


def run_sluice(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, float | None]:
    """(output tokens / wall time, decode rate after the first token: see the module docstring; None
    when every request stopped at its first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    completions = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    timings = [c.timings for c in completions]
    decode_seconds = max(t.finished for t in timings) - min(t.first_token for t in timings)
    decode_tokens = sum(len(c.token_ids) - 1 for c in completions)
    decode_rate = decode_tokens / decode_seconds if decode_tokens else None
    return sum(len(c.token_ids) for c in completions) / seconds, decode_rate


def run_transformers(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> float:
    """One static batch of all prompts (equal lengths, so no padding)."""
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    seconds = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / seconds


def run_llamacpp(
    python: str, model_path: str, prompts: list[list[int]], max_tokens: int, threads: int
) -> tuple[float | None, str]:
    """(tok/s, "") or (None, why not)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    try:
        done = subprocess.run(
            [
                python,
                str(RUNNER),
                model_path,
                f.name,
                "--max-tokens",
                str(max_tokens),
                "--threads",
                str(threads),
            ],
            capture_output=True,
            text=True,
            timeout=3600,
        )
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        return None, f"llama.cpp run failed: {done.stderr.strip().splitlines()[-1:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["output_tokens"] / result["seconds"], ""


def llamacpp_unavailable_reason(python: str | None) -> str | None:
    if python is None:
        return "no --llamacpp-python given (llama-cpp-python lives in its own environment)"
    check = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True)
    if check.returncode != 0:
        return f"{python} cannot import llama_cpp (pip install llama-cpp-python there; it builds from source)"
    return None


def print_table(rows: list[Row], concurrencies: list[int]) -> None:
    engines = list(dict.fromkeys(row.engine for row in rows))
    rate = {(row.engine, row.concurrency): row.tokens_per_second for row in rows}
    print(f"\n{'engine':<28}" + "".join(f"{f'{c} concurrent':>16}" for c in concurrencies))
    for engine in engines:
        cells = [rate.get((engine, c)) for c in concurrencies]
        print(f"{engine:<28}" + "".join(f"{'-' if v is None else f'{v:.1f} tok/s':>16}" for v in cells))
    sluice = engines[0]
    for other in engines[1:]:
        ratios = [
            f"{rate[(sluice, c)] / rate[(other, c)]:.2f}x"
            if rate.get((other, c)) and rate.get((sluice, c))
            else "-"
            for c in concurrencies
        ]
        print(f"{f'{sluice} / {other}':<28}" + "".join(f"{r:>16}" for r in ratios))
    for row in rows:
        if row.note:
            print(f"note: {row.engine} at {row.concurrency}: {row.note}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.cpu_race", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, help="torch and llama.cpp threads (default: physical cores)")
    parser.add_argument("--quantization", choices=["int4", "int8"], help="also run Sluice with this")
    parser.add_argument("--llamacpp-python", help="python of an environment with llama-cpp-python")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows and machine limits here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = configure_torch_threads(args.threads)
    retain_freed_memory()  # as the engine core process does; transformers, in this process, gains too
    model_path = default_model_path()
    bandwidth, gflops = read_bandwidth_gbs(), gemm_gflops()
    sluices = {"sluice fp32": LLM(dtype="float32")}
    if args.quantization:
        sluices[f"sluice {args.quantization}"] = LLM(dtype="float32", quantization=args.quantization)
    runner = next(iter(sluices.values())).engine.model_runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    embedding = runner.model.model.embed_tokens.weight
    if runner.model.lm_head.weight is not embedding:  # untied: the lookup reads one row per token
        weight_bytes -= embedding.numel() * embedding.element_size()
    floor = bandwidth * 1e9 / weight_bytes  # batch-1 tok/s with every fp32 weight read once per step
    print(
        f"torch {torch.__version__}, {threads} threads; read bandwidth {bandwidth:.1f} GB/s, "
        f"fp32 GEMM {gflops:.0f} GFLOP/s; fp32 weights read per step {weight_bytes / 1e6:.0f} MB "
        f"-> batch-1 floor {floor:.1f} tok/s (fp32)"
    )
    vocab = runner.arch.vocab_size
    hf_model = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
        ).eval()
    llama_reason = llamacpp_unavailable_reason(args.llamacpp_python)
    if llama_reason:
        print(f"llama.cpp: skipped: {llama_reason}")
    freeze_gc_heap()  # every model loaded, as the engine core process does once its engine is loaded
    warm = make_prompts(2, 16, vocab, args.seed + 1)
    for llm in sluices.values():
        run_sluice(llm, warm, 4)
    rows: list[Row] = []
    for concurrency in args.concurrency:
        prompts = make_prompts(concurrency, args.prompt_len, vocab, args.seed + concurrency)
        for name, llm in sluices.items():
            rate, decode_rate = run_sluice(llm, prompts, args.max_tokens)
            rows.append(Row(name, concurrency, rate, decode_tokens_per_second=decode_rate))
            print(rows[-1], flush=True)
            if concurrency == 1 and decode_rate is not None and name == "sluice fp32":
                print(  # the floor is the fp32 weights' (a quantized run reads fewer bytes)
                    f"{name} at batch 1: {rate / floor:.0%} of the floor with its prefill, "
                    f"{decode_rate / floor:.0%} decoding ({decode_rate:.1f} tok/s after the first token)"
                )
        if hf_model is not None:
            rows.append(
                Row(
                    "transformers static batch",
                    concurrency,
                    run_transformers(hf_model, prompts, args.max_tokens),
                )
            )
            print(rows[-1], flush=True)
        if llama_reason is None:
            rate, note = run_llamacpp(args.llamacpp_python, model_path, prompts, args.max_tokens, threads)
            rows.append(Row("llama.cpp (Q4_1 GGUF)", concurrency, rate, note))
            print(rows[-1], flush=True)
    print_table(rows, args.concurrency)
    if args.json:
        machine = {
            "threads": threads,
            "read_bandwidth_gbs": bandwidth,
            "gemm_gflops": gflops,
            "weight_bytes": weight_bytes,
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0],
        }
        Path(args.json).write_text(
            json.dumps({"machine": machine, "rows": [asdict(r) for r in rows]}, indent=2)
        )


if __name__ == "__main__":
    main()
