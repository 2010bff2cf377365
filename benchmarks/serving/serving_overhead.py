"""What serving costs: `sluice serve` over gRPC against the offline `LLM`, same model, same run.

    python -m sluice.benchmarks.serving.serving_overhead [--concurrency 1 16 64] [--json out.json]

Both sides run the model `sluice serve` serves by default (the embedded SmolLM2-135M unless --model) with
the server's default engine settings, on a fixed workload: seeded 64-token prompts, 64 output tokens,
greedy, ignore_eos. For each concurrency c, alternating sides:

    offline  LLM.generate on rounds of c prompts at once (the engine batches them)
    grpc     a closed loop of c Generate calls in flight to a `sluice serve` process on loopback

and prints output tokens/s of each, their ratio (gRPC / offline), and TTFT p50 (offline: from the
request's arrival in the engine; gRPC: as the client sees it, from sending the call). With `--repeats N`
each concurrency runs N such pairs, the order of the two sides swapped every other pair (so a machine
that drifts favours neither), and a last table gives each concurrency's median ratio: at concurrency 1 one
pair's ratio moved by 10-20% from run to run on a quiet 2-core VM (docs/BENCHMARKS.md). `--min-requests`
(default 8) shortens the pairs, for many of them in the same time.

Each concurrency's runs draw prompts of their own (both sides the same ones: each side has its own
prefix cache), and each warm-up its own, so no prompt is served from a prefix cache; the table's
"cached" column gives the prompt tokens each side's engine did serve from it (0 in an honest run). A
second table gives the CPU time each process spent per output token (user + system, from getrusage and
/proc): the offline process; the gRPC client (this process), the server's frontend and its engine core. A
third gives where the machine's CPUs went during each run, in cores (CPU seconds over the run's wall
seconds): each of those processes, and the CPUs left idle (`/proc/stat`'s idle + iowait of all CPUs), so
that a gap between the sides reads as CPU the serving path spent or time no thread ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass

from sluice.bench.runner import LoadConfig, run_load_sync, warm_up
from sluice.bench.transports import GenerateTransport
from sluice.bench.workloads import Workload
from sluice.benchmarks.serving.server_process import ServerProcess
from sluice.client import AsyncClient
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Side:
    name: str
    concurrency: int
    num_requests: int
    output_tokens: int
    seconds: float
    ttft_p50_ms: float
    cached_tokens: int | None  # prompt tokens the engine served from its prefix cache (None: unreported)
    cpu_seconds: dict[str, float]  # process -> CPU seconds it spent during the run
    window_seconds: float  # wall seconds between the CPU readings
    idle_cpu_seconds: float | None  # the machine's idle CPU seconds meanwhile (None without /proc/stat)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def offline_run(llm: LLM, workload: Workload, concurrency: int, num_requests: int) -> Side:
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    requests = [list(r.prompt_token_ids) for r in workload.requests(num_requests)]
    warmup = list(workload.warmup_request(0).prompt_token_ids)
    llm.generate([warmup], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    output_tokens, cached_tokens, ttfts, machine, cpu = 0, 0, [], machine_sample(), self_cpu_seconds()
    for first in range(0, num_requests, concurrency):
        for completion in llm.generate(requests[first : first + concurrency], params):
            output_tokens += len(completion.token_ids)
            cached_tokens += completion.cached_tokens
            ttfts.append(completion.timings.ttft_seconds)
    cpu_seconds = {"offline": self_cpu_seconds() - cpu}
    seconds, idle = machine_sample().since(machine)  # the run's wall seconds are its window's
    ttft_ms = 1000 * statistics.median(ttfts)
    return Side(
        "offline LLM",
        concurrency,
        num_requests,
        output_tokens,
        seconds,
        ttft_ms,
        cached_tokens,
        cpu_seconds,
        window_seconds=seconds,
        idle_cpu_seconds=idle,
    )


def grpc_run(server: ServerProcess, workload: Workload, concurrency: int, num_requests: int) -> Side:
    """The warm-up request goes before the CPU and wall readings, as the offline side's does."""
    asyncio.run(_warm_up(server.target, workload))
    load = LoadConfig(num_requests=num_requests, concurrency=concurrency, warmup_requests=0)
    pids = {"frontend": server.process.pid, "core": server.core_pid}
    machine = machine_sample()
    before = {"client": self_cpu_seconds()} | {name: pid_cpu_seconds(pid) for name, pid in pids.items()}
    result = run_load_sync(lambda: GenerateTransport(AsyncClient(server.target)), workload, load)
    after = {"client": self_cpu_seconds()} | {name: pid_cpu_seconds(pid) for name, pid in pids.items()}
    window, idle = machine_sample().since(machine)
    metrics = result.metrics
    if metrics.errors:
        raise RuntimeError(f"gRPC run failed requests: {metrics.errors}")
    return Side(
        "sluice serve (gRPC)",
        concurrency,
        num_requests,
        metrics.output_tokens,
        metrics.duration_seconds,
        1000 * metrics.ttft.p50,
        metrics.cached_prompt_tokens,
        {name: after[name] - before[name] for name in before},
        window_seconds=window,
        idle_cpu_seconds=idle,
    )


async def _warm_up(target: str, workload: Workload) -> None:
    transport = GenerateTransport(AsyncClient(target))
    try:
        await warm_up(transport, workload, 1)
    finally:
        await transport.close()


@dataclass(frozen=True)
class MachineSample:
    wall: float  # time.perf_counter()
    idle: float | None  # idle CPU seconds of all CPUs together since boot; None without /proc/stat

    def since(self, earlier: MachineSample) -> tuple[float, float | None]:
        """(wall seconds, idle CPU seconds) from `earlier` to this sample."""
        idle = None if self.idle is None or earlier.idle is None else self.idle - earlier.idle
        return self.wall - earlier.wall, idle


def machine_sample() -> MachineSample:
    try:
        with open("/proc/stat") as f:
            idle = idle_cpu_seconds(f.readline())
    except OSError:
        idle = None
    return MachineSample(time.perf_counter(), idle)


def idle_cpu_seconds(cpu_line: str) -> float:
    """Idle + iowait seconds of all CPUs from /proc/stat's first line ("cpu user nice system idle iowait
    ..." in clock ticks)."""
    fields = cpu_line.split()
    if fields[0] != "cpu":
        raise ValueError(f"not /proc/stat's total line: {cpu_line!r}")
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pid_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def format_table(pairs: list[tuple[Side, Side]]) -> str:
    lines = [
        "| concurrency | offline tok/s | gRPC tok/s | gRPC / offline "
        "| TTFT p50 offline | TTFT p50 gRPC | ratio | cached offline / gRPC |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for offline, grpc in pairs:
        lines.append(
            f"| {offline.concurrency} | {offline.tokens_per_second:.1f} | {grpc.tokens_per_second:.1f} | "
            f"{grpc.tokens_per_second / offline.tokens_per_second:.3f} | {offline.ttft_p50_ms:.0f} ms | "
            f"{grpc.ttft_p50_ms:.0f} ms | {grpc.ttft_p50_ms / offline.ttft_p50_ms:.2f}x | "
            f"{offline.cached_tokens} / {grpc.cached_tokens} |"
        )
    return "\n".join(lines)


def format_cpu_table(pairs: list[tuple[Side, Side]]) -> str:
    """CPU milliseconds per output token, per process."""
    lines = [
        "| concurrency | offline | gRPC total | client | frontend | core |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for offline, grpc in pairs:
        per_token = lambda side, name: 1000 * side.cpu_seconds[name] / side.output_tokens
        parts = [per_token(grpc, name) for name in ("client", "frontend", "core")]
        lines.append(
            f"| {offline.concurrency} | {per_token(offline, 'offline'):.2f} | {sum(parts):.2f} | "
            + " | ".join(f"{part:.2f}" for part in parts)
            + " |"
        )
    return "\n".join(lines)


def format_cores_table(pairs: list[tuple[Side, Side]]) -> str:
    """Cores busy per process during each run (its CPU seconds over the run's wall seconds), and idle."""
    lines = [
        "| concurrency | offline | idle (offline) | gRPC core | frontend | client | idle (gRPC) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def cores(seconds: float | None, side: Side) -> str:
        return "-" if seconds is None else f"{seconds / side.window_seconds:.2f}"

    for offline, grpc in pairs:
        cells = [cores(offline.cpu_seconds["offline"], offline), cores(offline.idle_cpu_seconds, offline)]
        cells += [cores(grpc.cpu_seconds[name], grpc) for name in ("core", "frontend", "client")]
        cells.append(cores(grpc.idle_cpu_seconds, grpc))
        lines.append(f"| {offline.concurrency} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_median_table(pairs: list[tuple[Side, Side]]) -> str:
    """Per concurrency: the median of each side's tok/s and of the pairs' ratios, and the ratios' range."""
    lines = [
        "| concurrency | pairs | offline tok/s | gRPC tok/s | gRPC / offline (median) | min | max |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for concurrency in dict.fromkeys(offline.concurrency for offline, _ in pairs):
        runs = [(offline, grpc) for offline, grpc in pairs if offline.concurrency == concurrency]
        ratios = [grpc.tokens_per_second / offline.tokens_per_second for offline, grpc in runs]
        offline_median = statistics.median(offline.tokens_per_second for offline, _ in runs)
        grpc_median = statistics.median(grpc.tokens_per_second for _, grpc in runs)
        lines.append(
            f"| {concurrency} | {len(runs)} | {offline_median:.1f} | {grpc_median:.1f} | "
            f"{statistics.median(ratios):.3f} | {min(ratios):.3f} | {max(ratios):.3f} |"
        )
    return "\n".join(lines)


def cache_warnings(pairs: list[tuple[Side, Side]]) -> list[str]:
    """A line for each side whose engine served prompt tokens from its prefix cache: none is repeated."""
    return [
        f"warning: {side.name} at concurrency {side.concurrency}: {side.cached_tokens} prompt tokens "
        "served from the prefix cache, though no prompt repeats: that run measured the cache"
        for pair in pairs
        for side in pair
        if side.cached_tokens
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.serving.serving_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--rounds", type=int, default=2, help="requests per concurrency = rounds x c (>= --min-requests)"
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=8,
        help="the fewest requests a side runs (default 8); fewer make shorter pairs, more of them per minute",
    )
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="offline / gRPC pairs per concurrency")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.min_requests < 1:
        parser.error("--min-requests must be at least 1")

    llm = LLM(args.model)
    vocab_size = llm.engine.model_info.vocab_size
    workload = Workload("fixed", vocab_size, input_len=args.input_len, output_len=args.output_len)
    serve_args = [] if args.model is None else ["--model", args.model]
    pairs = []
    with ServerProcess(serve_args) as server:
        for concurrency in args.concurrency:
            num_requests = max(args.min_requests, args.rounds * concurrency)
            for repeat in range(args.repeats):
                run = workload.for_run(len(pairs))
                if repeat % 2 == 0:
                    offline = offline_run(llm, run, concurrency, num_requests)
                    grpc = grpc_run(server, run, concurrency, num_requests)
                else:
                    grpc = grpc_run(server, run, concurrency, num_requests)
                    offline = offline_run(llm, run, concurrency, num_requests)
                pairs.append((offline, grpc))
                print(format_table(pairs[-1:]).splitlines()[-1], flush=True)
    print(f"\nmodel: {llm.engine.model_info.name}; {args.input_len}-token prompts, {args.output_len} out\n")
    print(format_table(pairs))
    for warning in cache_warnings(pairs):
        print(warning)
    print("\nCPU ms per output token\n")
    print(format_cpu_table(pairs))
    print("\nCores busy during each run, per process, and the machine's idle cores\n")
    print(format_cores_table(pairs))
    if args.repeats > 1:
        print(f"\nMedians over {args.repeats} alternated pairs\n")
        print(format_median_table(pairs))
    if args.json:
        rows = [asdict(s) | {"tokens_per_second": s.tokens_per_second} for pair in pairs for s in pair]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
