"""CPU race on the embedded SmolLM2-135M: Sluice's offline `LLM` against `transformers.generate` (static
batches) and llama.cpp (llama-cpp-python, batched sequences) on the same GGUF, in one run.

    # 1, 16, 64 concurrent requests
    python -m sluice.benchmarks.engine.cpu_race
    python -m sluice.benchmarks.engine.cpu_race --llamacpp-python ../llamacpp/bin/python --json race.json
    python -m sluice.benchmarks.engine.cpu_race --quantization int4              # adds a Sluice int4 column
    # medians of 3 interleaved rounds
    python -m sluice.benchmarks.engine.cpu_race --rounds 3

Every engine gets the same random 64-token prompts and decodes 64 greedy tokens each (no EOS stop); a
run's tok/s is its output tokens over its wall time, prefill included. For Sluice the run also gives its
decode rate: the tokens after each request's first over the time from the first first token to the last
finish, which at batch 1 is the steady decode step the bandwidth floor describes (no prefill in it).
Sluice and transformers run in float32 on the GGUF's dequantized weights; llama.cpp runs the Q4_1 file
as is. llama.cpp needs llama-cpp-python, which builds from source, so it lives in its own environment
(`--llamacpp-python`); without one, its column says why. The machine's limits are measured first: read
bandwidth, the fp32 GEMM rate of torch's BLAS and numpy's, and the floor they set on each run of Sluice's
fp32 weights (benchmarks/engine/machine_limits.py: memory-bound at batch 1, compute-bound from a few rows up).

On a shared or virtual machine a run samples the minute it runs in. So the limits are probed again right
before each Sluice fp32 run, whose share of the floor is the floor of its own minute; and `--rounds N`
repeats the whole sweep N times, the engines in reverse order every other round, each round on new
prompts (Sluice's prefix cache would serve a repeat's). The table then gives each cell's median over the
rounds, and each ratio as the median of the rounds' own ratios (engines seconds to minutes apart, not a
round apart) with their range. The warm-up's prompts are drawn apart from the race's too. Each Sluice
run records the prompt tokens its engine served from the prefix cache (its JSON row's cached_tokens):
0, or the table ends with a warning that the run timed the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sluice.benchmarks.engine.machine_limits import (
    Roofline,
    fp32_weight_bytes,
    gemm_gflops,
    linear_flops_per_request,
    read_bandwidth_gbs,
)
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.default_model import default_model_path
from sluice.engine.process.host_memory import freeze_gc_heap, retain_freed_memory
from sluice.engine.process.threads import configure_torch_threads
from sluice.engine.sampling_params import SamplingParams

RUNNER = Path(__file__).with_name("llamacpp_runner.py")


@dataclass(frozen=True)
class Row:
    engine: str
    concurrency: int
    tokens_per_second: float | None
    note: str = ""
    decode_tokens_per_second: float | None = None  # Sluice only: after the first token, see above
    round: int = 0
    cached_tokens: int | None = None  # Sluice only: prompt tokens served from its prefix cache (0)


def make_prompts(count: int, prompt_len: int, vocab_size: int, seed: int | str) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(count)]


def run_sluice(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, float | None, int]:
    """(output tokens / wall time, decode rate after the first token: see the module docstring (None
    when every request stopped at its first token), prompt tokens served from the prefix cache)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    completions = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    timings = [c.timings for c in completions]
    decode_seconds = max(t.finished for t in timings) - min(t.first_token for t in timings)
    decode_tokens = sum(len(c.token_ids) - 1 for c in completions)
    decode_rate = decode_tokens / decode_seconds if decode_tokens else None
    cached_tokens = sum(c.cached_tokens for c in completions)
    return sum(len(c.token_ids) for c in completions) / seconds, decode_rate, cached_tokens


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
    """Each engine's tok/s at each concurrency (the median over rounds), then Sluice's over each other
    engine's: with one round the ratio, with several the median of the rounds' own ratios and their range."""
    engines = list(dict.fromkeys(row.engine for row in rows))
    rates: dict[tuple[str, int], dict[int, float]] = {}
    for row in rows:
        if row.tokens_per_second:
            rates.setdefault((row.engine, row.concurrency), {})[row.round] = row.tokens_per_second
    print(f"\n{'engine':<42}" + "".join(f"{f'{c} concurrent':>20}" for c in concurrencies))
    for engine in engines:
        cells = [rates.get((engine, c)) for c in concurrencies]
        text = [f"{statistics.median(v.values()):.1f} tok/s" if v else "-" for v in cells]
        print(f"{engine:<42}" + "".join(f"{t:>20}" for t in text))
    sluice = engines[0]
    for other in engines[1:]:
        cells = []
        for c in concurrencies:
            ours, theirs = rates.get((sluice, c), {}), rates.get((other, c), {})
            ratios = [ours[r] / theirs[r] for r in ours.keys() & theirs.keys()]
            cells.append(_ratio_text(ratios))
        print(f"{f'{sluice} / {other}':<42}" + "".join(f"{t:>20}" for t in cells))
    for row in rows:
        if row.note:
            print(f"note: {row.engine} at {row.concurrency}: {row.note}")
        if row.cached_tokens:
            print(
                f"warning: {row.engine} at {row.concurrency}, round {row.round}: {row.cached_tokens} prompt "
                "tokens served from the prefix cache, though its prompts are new: that run timed the cache"
            )


def print_floor_shares(rows: list[Row], floors: list[dict]) -> None:
    """With several rounds: each Sluice fp32 run's rate over the floor probed before it, by concurrency."""
    rates = {(r.round, r.concurrency): r.tokens_per_second for r in rows if r.engine == "sluice fp32"}
    for concurrency in dict.fromkeys(f["concurrency"] for f in floors):
        shares = [
            rates[f["round"], concurrency] / f["floor"]
            for f in floors
            if f["concurrency"] == concurrency and rates.get((f["round"], concurrency))
        ]
        if len(shares) > 1:
            print(
                f"sluice fp32 at {concurrency}, of the floor probed before it: "
                f"{statistics.median(shares):.0%} ({', '.join(f'{share:.0%}' for share in shares)})"
            )


def _ratio_text(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}x"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.engine.cpu_race", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, help="torch and llama.cpp threads (default: physical cores)")
    parser.add_argument("--quantization", choices=["int4", "int8"], help="also run Sluice with this")
    parser.add_argument("--llamacpp-python", help="python of an environment with llama-cpp-python")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the sweep, interleaved (see above)")
    parser.add_argument("--json", help="write the rows and machine limits here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: must be >= 1, got {args.rounds}")
    return args


# (tok/s, decode tok/s, note, prompt tokens served from a prefix cache)
Runner = Callable[[list[list[int]]], tuple[float | None, float | None, str, int | None]]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = configure_torch_threads(args.threads)
    retain_freed_memory()  # as the engine core process does; transformers, in this process, gains too
    model_path = default_model_path()
    sluices = {"sluice fp32": LLM(dtype="float32")}
    if args.quantization:
        sluices[f"sluice {args.quantization}"] = LLM(dtype="float32", quantization=args.quantization)
    runner = next(iter(sluices.values())).engine.model_runner
    model, vocab = runner.model, runner.arch.vocab_size
    weight_bytes = fp32_weight_bytes(model)
    flops = linear_flops_per_request(model, args.prompt_len, args.max_tokens)

    roofline, gemm = probe_roofline(weight_bytes, flops, args.max_tokens)
    print(
        f"torch {torch.__version__}, {threads} threads; "
        f"read bandwidth {roofline.read_bandwidth_gbs:.1f} GB/s; "
        f"fp32 GEMM {', '.join(f'{name} {rate:.0f}' for name, rate in gemm.items())} GFLOP/s; "
        f"fp32 weights read per step {weight_bytes / 1e6:.0f} MB, linears {flops / 1e9:.1f} GFLOP a request "
        f"-> floor {', '.join(f'{roofline.tokens_per_second(c):.1f}' for c in args.concurrency)} tok/s "
        f"at {', '.join(map(str, args.concurrency))} (fp32)"
    )
    machine = {
        "threads": threads,
        "read_bandwidth_gbs": roofline.read_bandwidth_gbs,
        "gemm_gflops": gemm,
        "weight_bytes": weight_bytes,
        "linear_flops_per_request": flops,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "floors": [],  # probed again right before each Sluice fp32 run
    }
    runners = make_runners(args, sluices, model_path, vocab, threads)
    freeze_gc_heap()  # every model loaded, as the engine core process does once its engine is loaded
    rows: list[Row] = []
    for round_index in range(args.rounds):
        order = list(runners.items()) if round_index % 2 == 0 else list(runners.items())[::-1]
        for concurrency in args.concurrency:
            prompts = race_prompts(args, vocab, round_index, concurrency)
            for name, run in order:
                if name == "sluice fp32":
                    roofline, gemm = probe_roofline(weight_bytes, flops, args.max_tokens)
                    machine["floors"].append(floor_record(round_index, concurrency, roofline, gemm))
                rate, decode_rate, note, cached_tokens = run(prompts)
                rows.append(Row(name, concurrency, rate, note, decode_rate, round_index, cached_tokens))
                print(rows[-1], flush=True)
                if name == "sluice fp32" and rate is not None:
                    print_share(name, concurrency, rate, decode_rate, roofline)
    print_table(rows, args.concurrency)
    print_floor_shares(rows, machine["floors"])
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": machine, "rows": [asdict(r) for r in rows]}, indent=2)
        )


def probe_roofline(weight_bytes: int, flops: int, max_tokens: int) -> tuple[Roofline, dict[str, float]]:
    """The machine's limits this minute, and each library's GEMM rate."""
    gemm = gemm_gflops()  # first: numpy's BLAS threads must be idle by the bandwidth probe and the run
    return Roofline(read_bandwidth_gbs(), max(gemm.values()), weight_bytes, flops, max_tokens), gemm


def floor_record(round_index: int, concurrency: int, roofline: Roofline, gemm: dict[str, float]) -> dict:
    return {
        "round": round_index,
        "concurrency": concurrency,
        "read_bandwidth_gbs": roofline.read_bandwidth_gbs,
        "gemm_gflops": gemm,
        "bound": roofline.bound(concurrency),
        "floor": roofline.tokens_per_second(concurrency),
    }


def print_share(name: str, concurrency: int, rate: float, decode: float | None, roofline: Roofline) -> None:
    """A run's rate against the floor probed right before it (of the fp32 weights: a quantized run reads
    fewer bytes); at batch 1 also its decode rate after the first token, against the same floor."""
    floor = roofline.tokens_per_second(concurrency)
    text = f"{name} at {concurrency}: {rate / floor:.0%} of the floor probed before it "
    text += f"({roofline.why(concurrency)})"
    if concurrency == 1 and decode is not None:
        text += f"; {decode / floor:.0%} decoding ({decode:.1f} tok/s after the first token)"
    print(text)


def race_prompts(
    args: argparse.Namespace, vocab_size: int, round_index: int, concurrency: int
) -> list[list[int]]:
    """The prompts of one round at one concurrency: new in every round, or a repeat would be served from
    Sluice's prefix cache (round 0's are those of the single-round races before --rounds)."""
    seed = args.seed + concurrency + 10_000 * round_index
    return make_prompts(concurrency, args.prompt_len, vocab_size, seed)


def _sluice_runner(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple:
    """run_sluice's figures as a Runner gives them (no note)."""
    rate, decode_rate, cached_tokens = run_sluice(llm, prompts, max_tokens)
    return rate, decode_rate, "", cached_tokens


def make_runners(
    args: argparse.Namespace, sluices: dict[str, LLM], model_path: str, vocab_size: int, threads: int
) -> dict[str, Runner]:
    """Each engine of the race, by name, as a function of the prompts; Sluice's engines warmed up."""
    runners: dict[str, Runner] = {}
    warm = make_prompts(2, 16, vocab_size, f"warm-up {args.seed}")  # no prefix of any race prompt
    for name, llm in sluices.items():
        run_sluice(llm, warm, 4)
        runners[name] = lambda prompts, llm=llm: _sluice_runner(llm, prompts, args.max_tokens)
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
        ).eval()
        runners["transformers static batch"] = lambda prompts: (
            run_transformers(hf_model, prompts, args.max_tokens),
            None,
            "",
            None,
        )
    llama_reason = llamacpp_unavailable_reason(args.llamacpp_python)
    if llama_reason:
        print(f"llama.cpp: skipped: {llama_reason}")
    else:

        def run_llama(prompts: list[list[int]]) -> tuple[float | None, None, str, None]:
            rate, note = run_llamacpp(args.llamacpp_python, model_path, prompts, args.max_tokens, threads)
            return rate, None, note, None

        runners["llama.cpp (Q4_1 GGUF)"] = run_llama
    return runners


if __name__ == "__main__":
    main()
