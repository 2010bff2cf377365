"""`sluice bench`: drive a running server over gRPC and report serving metrics.

sluice bench --target localhost:50051 --workload chat --request-rate 4 --num-requests 200
sluice bench --target localhost:50051 --concurrency 8 --duration 60 --json out.json --plot charts/
sluice bench --target localhost:50051 --sweep 1,2,4,8 --num-requests 64 --plot charts/
sluice bench compare before.json after.json
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from dataclasses import asdict, replace
from typing import Any

from sluice.bench import report
from sluice.bench.metrics import Slo
from sluice.bench.runner import LoadConfig, run_load
from sluice.bench.transports import GenerateTransport, StreamTransport, Transport
from sluice.bench.workloads import FIRST_PROMPT_TOKEN, WORKLOAD_KINDS, Workload
from sluice.client import AsyncClient, SluiceError
from sluice.tls_flags import add_tls_flags, tls_client_options


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="localhost:50051", help="HOST:PORT of the server")
    parser.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"), help="or SLUICE_API_KEY")
    add_tls_flags(parser)
    parser.add_argument(
        "--api",
        choices=("generate", "stream"),
        default="generate",
        help="one Generate call per request, or all on one bidi StreamGenerate call",
    )
    parser.add_argument("--workload", choices=WORKLOAD_KINDS, default="fixed")
    parser.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="prompt tokens (chat: median; shared-prefix: the unique suffix)",
    )
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (chat: median)")
    parser.add_argument("--sigma", type=float, default=0.8, help="chat: log-normal shape")
    parser.add_argument("--max-input-len", type=int, default=2048, help="chat: prompt length clip")
    parser.add_argument("--max-output-len", type=int, default=1024, help="chat: output length clip")
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the served model's")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="each run of a sweep draws its prompts from this and its index; default: a new one each "
        "command (printed, and in the JSON), so that no command replays another's prompts",
    )
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    parser.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument(
        "--sweep", type=_concurrencies, default=None, help="comma-separated concurrencies, one run each"
    )
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--num-requests", type=int, default=None, help="default 100")
    stop.add_argument("--duration", type=float, default=None, help="seconds of sending")
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests sent first")
    parser.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO on TTFT, ms")
    parser.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO on TPOT, ms")
    parser.add_argument("--label", default=None, help="name of the run in tables and charts")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    parser.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here")
    parser.add_argument("--no-progress", action="store_true")
    compare = parser.add_subparsers(dest="bench_command", metavar="compare").add_parser(
        "compare", help="print each metric of two --json files and the ratio B/A"
    )
    compare.add_argument("a", help="baseline JSON (A)")
    compare.add_argument("b", help="JSON to compare (B)")


def _concurrencies(text: str) -> list[int]:
    """--sweep's type: "1,2,4" -> [1, 2, 4] (LoadConfig checks that each is >= 1)."""
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None


class Progress:
    """One self-overwriting stderr line, at most ten updates a second."""

    def __init__(self, label: str, total: int | None, enabled: bool) -> None:
        self._label, self._total, self._enabled = label, total, enabled
        self._shown = 0.0

    def __call__(self, finished: int, sent: int, elapsed: float) -> None:
        if not self._enabled or (time.monotonic() - self._shown < 0.1 and finished != self._total):
            return
        self._shown = time.monotonic()
        total = f"/{self._total}" if self._total else ""
        sys.stderr.write(
            f"\r[{self._label}] {finished}{total} done, {sent - finished} in flight, {elapsed:.1f}s "
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self._enabled:
            sys.stderr.write("\n")


def _client(args: argparse.Namespace) -> AsyncClient:
    return AsyncClient(args.target, api_key=args.api_key, **tls_client_options(args))


def _transport(args: argparse.Namespace) -> Transport:
    client = _client(args)
    return StreamTransport(client) if args.api == "stream" else GenerateTransport(client)


async def _served_vocab_size(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        return (await client.model_info(timeout=30)).vocab_size


def _workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    return Workload(
        kind=args.workload,
        vocab_size=vocab_size,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        sigma=args.sigma,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        prefix_len=args.prefix_len,
    )


def _plan(args: argparse.Namespace) -> tuple[Workload, list[LoadConfig], Slo]:
    """The workload, one load per run and the SLO, validated, and the outputs checked: a ValueError
    before anything connects. Without --vocab-size the workload's vocabulary is a stand-in until the
    server's is known."""
    _check_outputs(args)
    tls_client_options(args)  # the TLS flags' files readable, before anything connects
    if args.sweep and args.concurrency is not None:  # each run's concurrency is the sweep's
        raise ValueError("sweep: sets each run's concurrency; drop --concurrency")
    workload = _workload(args, FIRST_PROMPT_TOKEN + 1 if args.vocab_size is None else args.vocab_size)
    loads = [
        LoadConfig(
            num_requests=args.num_requests if args.duration is None else None,
            duration=args.duration,
            request_rate=args.request_rate,
            concurrency=concurrency,
            warmup_requests=args.warmup,
        )
        for concurrency in args.sweep or [args.concurrency]
    ]
    slo = Slo(*(None if v is None else v / 1e3 for v in (args.slo_ttft, args.slo_tpot)))
    return workload, loads, slo


def _check_outputs(args: argparse.Namespace) -> None:
    """A ValueError naming --json or --plot if the run's results could not be written there."""
    if args.json and (problem := _file_problem(args.json)):
        raise ValueError(f"--json: {problem}")
    if args.plot and (problem := _directory_problem(args.plot)):
        raise ValueError(f"--plot: {problem}")


def _file_problem(path: str) -> str | None:
    """Why the file `path` could not be written, or None."""
    if os.path.isdir(path):
        return f"{path} is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    parent = os.path.dirname(os.path.abspath(path))
    return _directory_problem(parent) if os.path.exists(parent) else f"no directory {parent}"


def _directory_problem(path: str) -> str | None:
    """Why files could not be written in the directory `path`, made as by makedirs if missing, or None."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # makedirs would make it and the others missing below
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    return None if os.access(existing, os.W_OK) else f"{existing} is not writable"


async def _one_run(
    args: argparse.Namespace, workload: Workload, load: LoadConfig, slo: Slo, run_index: int
) -> dict[str, Any]:
    """Run `run_index` of the sweep, on prompts of its own (no run or warm-up repeats another's)."""
    workload = workload.for_run(run_index)
    label = args.label or (f"concurrency {load.concurrency}" if args.sweep else args.workload)
    progress = Progress(label, load.num_requests, not args.no_progress)
    transport = _transport(args)
    try:
        result = await run_load(transport, workload, load, slo=slo, progress=progress)
    finally:
        progress.close()
        await transport.close()
    config = {"target": args.target, "api": args.api, "seed": args.seed, "run_index": run_index}
    config |= {"workload": asdict(workload)} | asdict(load) | {"slo_ttft": slo.ttft, "slo_tpot": slo.tpot}
    return report.run_document(
        label, config, result.metrics, result.records, shared_prefix_len=workload.shared_prefix_len
    )


async def _bench(
    args: argparse.Namespace, workload: Workload, loads: list[LoadConfig], slo: Slo
) -> list[dict[str, Any]]:
    if args.vocab_size is None:
        workload = replace(workload, vocab_size=await _served_vocab_size(args))
    return [await _one_run(args, workload, load, slo, i) for i, load in enumerate(loads)]


def _write_json(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[str]:
    if not args.json:
        return []
    report.write_json(args.json, runs)
    return [args.json]


def _write_plots(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[str]:
    if not args.plot:
        return []
    from sluice.bench import plot

    paths = [plot.latency_cdfs(runs, os.path.join(args.plot, "latency_cdfs.png"))]
    if args.sweep:
        paths.append(plot.sweep(runs, os.path.join(args.plot, "sweep.png")))
    return paths


def _write_outputs(args: argparse.Namespace, runs: list[dict[str, Any]]) -> bool:
    """Writes --json and --plot; for each it cannot write, prints one line and returns False."""
    written = True
    for option, write in (("--json", _write_json), ("--plot", _write_plots)):
        try:
            paths = write(args, runs)
        except OSError as exc:
            print(f"sluice bench: {option}: {exc}", file=sys.stderr)
            written = False
        else:
            if paths:
                print(f"wrote {', '.join(paths)}", file=sys.stderr)
    return written


def _compare(args: argparse.Namespace) -> int:
    try:
        print(report.compare(report.read_json(args.a), report.read_json(args.b)))
    except (OSError, ValueError) as exc:
        print(f"sluice bench compare: {exc}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "compare":
        return _compare(args)
    if args.num_requests is None and args.duration is None:
        args.num_requests = 100
    drawn = args.seed is None  # a fixed default replayed one command's prompts in the next: cache hits
    if drawn:
        args.seed = random.SystemRandom().randrange(2**31)
    try:
        plan = _plan(args)
        if drawn:  # once the options passed, before anything is sent
            print(f"sluice bench: prompts drawn with --seed {args.seed}", file=sys.stderr)
        runs = asyncio.run(_bench(args, *plan))
    except (ValueError, SluiceError) as exc:
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 2
    print(report.format_runs(runs))
    written = _write_outputs(args, runs)
    return 0 if written and all(run["metrics"]["num_completed"] for run in runs) else 1
