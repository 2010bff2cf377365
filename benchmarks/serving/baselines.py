"""`make bench`: one workload through Sluice and through its baselines, in the same run, as ratios.

    python -m sluice.benchmarks.serving.baselines --out bench-results

On a random-weight checkpoint of a preset's shape (built once with transformers, so every side runs
the very same weights), measures:

    throughput   one shared-prefix workload, all requests sent at once, through
                 (a) Sluice over gRPC (a `sluice serve` subprocess on a loopback port),
                 (b) transformers.generate one request at a time, (c) in static batches,
                 (d) Sluice with prefix caching off, (e) Sluice with chunked prefill off,
                 (f) the AsyncEngine without gRPC (its engine core in its own process, as the
                 server runs it): the gRPC layer's cost
    decode ITL   running decodes while long prompts arrive, chunked prefill on (small token budget)
                 against off (the budget must then hold a whole prompt)

Prints the tables, writes make_bench.json (everything), runs.json (the Sluice runs, readable by
`sluice bench compare`) and PNG charts into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sluice.bench import plot, report
from sluice.bench.metrics import unexpected_cache_hits
from sluice.bench.runner import LoadConfig, run_load, run_load_sync, warm_up
from sluice.bench.transports import GenerateTransport
from sluice.bench.workloads import Workload
from sluice.benchmarks.engine.offline import build_checkpoint, run_hf_sequential, run_hf_static_batches
from sluice.benchmarks.serving.baseline_report import effects, print_report, throughput
from sluice.benchmarks.serving.engine_transport import EngineTransport
from sluice.benchmarks.serving.server_process import ServerProcess
from sluice.client import AsyncClient
from sluice.engine.loading.presets import PRESETS


@dataclass(frozen=True)
class Plan:
    """Sizes chosen so the whole run stays under ten minutes on two CPU cores."""

    preset: str = "tiny"
    seed: int = 0
    num_requests: int = 16
    prefix_len: int = 384  # shared system prompt
    input_len: int = 64  # unique suffix of every prompt
    output_len: int = 32
    static_batch: int = 8
    num_decodes: int = 4  # decode ITL scenario: requests decoding throughout ...
    decode_output_len: int = 96
    num_long_prompts: int = 4  # ... while prompts of this length arrive at this rate
    long_prompt_len: int = 1536
    long_prompt_rate: float = 2.0
    chunk_budget: int = 256  # max_num_batched_tokens with chunked prefill on

    @property
    def vocab_size(self) -> int:
        return PRESETS[self.preset]["vocab_size"]

    def workload(self) -> Workload:
        return Workload(
            "shared-prefix",
            self.vocab_size,
            seed=self.seed,
            input_len=self.input_len,
            output_len=self.output_len,
            prefix_len=self.prefix_len,
        )


def grpc_run(label: str, model_dir: str, serve_args: list[str], workload: Workload, load: LoadConfig):
    with ServerProcess(["--model", model_dir, *serve_args]) as server:
        result = run_load_sync(lambda: GenerateTransport(AsyncClient(server.target)), workload, load)
    config = {"transport": "grpc", "serve_args": serve_args, "workload": asdict(workload)} | asdict(load)
    shared = workload.shared_prefix_len
    return report.run_document(label, config, result.metrics, result.records, shared_prefix_len=shared)


def in_process_run(label: str, model_dir: str, workload: Workload, load: LoadConfig) -> dict[str, Any]:
    from sluice.service.serve_command import configure, engine_config

    parser = argparse.ArgumentParser()
    configure(parser)
    config = engine_config(parser.parse_args(["--model", model_dir]))  # exactly the server's defaults

    async def main():
        transport = await EngineTransport.create(config)
        try:
            return await run_load(transport, workload, load)
        finally:
            await transport.close()

    result = asyncio.run(main())
    run_config = {"transport": "in-process", "workload": asdict(workload)} | asdict(load)
    shared = workload.shared_prefix_len
    return report.run_document(label, run_config, result.metrics, result.records, shared_prefix_len=shared)


def transformers_run(label: str, run: Any, num_requests: int, warmup: Any) -> dict[str, Any]:
    warmup()
    result = run()
    return {
        "label": label,
        "seconds": result.seconds,
        "output_tokens": result.output_tokens,
        "output_throughput": result.output_tokens / result.seconds,
        "request_throughput": num_requests / result.seconds,
    }


def throughput_runs(plan: Plan, model_dir: str, model: torch.nn.Module) -> tuple[list, list]:
    workload, load = plan.workload(), LoadConfig(num_requests=plan.num_requests)
    sluice = [
        grpc_run("sluice gRPC", model_dir, [], workload, load),
        grpc_run("sluice gRPC, prefix caching off", model_dir, ["--no-prefix-caching"], workload, load),
        grpc_run("sluice gRPC, chunked prefill off", model_dir, ["--no-chunked-prefill"], workload, load),
        in_process_run("sluice in-process", model_dir, workload, load),
    ]
    prompts = [list(r.prompt_token_ids) for r in workload.requests(plan.num_requests)]
    n, out = plan.num_requests, plan.output_len
    warmup = lambda: run_hf_sequential(model, prompts[:1], 2)
    baselines = [
        transformers_run(
            "transformers sequential", lambda: run_hf_sequential(model, prompts, out), n, warmup
        ),
        transformers_run(
            f"transformers static batch {plan.static_batch}",
            lambda: run_hf_static_batches(model, prompts, out, plan.static_batch),
            n,
            warmup,
        ),
    ]
    return sluice, baselines


async def _decodes_during_long_prompts(target: str, plan: Plan) -> tuple:
    """The decodes and the long prompts draw prompts of their own, and the warm-up from its own stream:
    no prompt is served from the prefix cache."""
    decodes = Workload("fixed", plan.vocab_size, plan.seed, input_len=32, output_len=plan.decode_output_len)
    longs = Workload("fixed", plan.vocab_size, plan.seed, input_len=plan.long_prompt_len, output_len=4)
    decodes, longs = decodes.for_run(0), longs.for_run(1)
    transport = GenerateTransport(AsyncClient(target))
    try:
        await warm_up(transport, decodes, 1)
        decode_load = LoadConfig(num_requests=plan.num_decodes, warmup_requests=0)
        long_load = LoadConfig(
            num_requests=plan.num_long_prompts, request_rate=plan.long_prompt_rate, warmup_requests=0
        )

        async def long_prompts_later():
            await asyncio.sleep(0.5)  # the decodes are past their prefill and decoding
            return await run_load(transport, longs, long_load)

        return await asyncio.gather(run_load(transport, decodes, decode_load), long_prompts_later())
    finally:
        await transport.close()


def decode_itl_runs(plan: Plan, model_dir: str) -> list[dict[str, Any]]:
    configs = (
        ("chunked prefill on", ["--max-num-batched-tokens", str(plan.chunk_budget)]),
        ("chunked prefill off", ["--no-chunked-prefill", "--max-num-batched-tokens", "2048"]),
    )
    runs = []
    for label, serve_args in configs:
        with ServerProcess(["--model", model_dir, *serve_args]) as server:
            decodes, longs = asyncio.run(_decodes_during_long_prompts(server.target, plan))
        config = {"serve_args": serve_args, "plan": asdict(plan)}
        run = report.run_document(f"decodes, {label}", config, decodes.metrics, decodes.records)
        run["long_prompts"] = longs.metrics.to_dict()
        run["long_prompts_cache_hits_unexpected"] = unexpected_cache_hits(longs.records, 0) > 0
        runs.append(run)
    return runs


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "load_average_at_start": os.getloadavg(),
    }


def write_outputs(out_dir: str, document: dict[str, Any]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    report.write_json(os.path.join(out_dir, "runs.json"), document["sluice"] + document["decode_itl"])
    with open(os.path.join(out_dir, "make_bench.json"), "w") as f:
        json.dump(document, f, indent=1)
    rows = document["sluice"] + document["transformers"]
    return [
        plot.bars(
            [r["label"] for r in rows],
            [throughput(r) for r in rows],
            os.path.join(out_dir, "throughput.png"),
            title="Output throughput, same workload and weights",
            ylabel="output tokens / s",
        ),
        plot.latency_cdfs(document["sluice"], os.path.join(out_dir, "latency_cdfs.png")),
        plot.latency_cdfs(document["decode_itl"], os.path.join(out_dir, "chunked_prefill_itl.png")),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.serving.baselines", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", default="bench-results", help="directory for JSON and PNGs")
    parser.add_argument("--preset", default=Plan.preset, choices=sorted(PRESETS))
    parser.add_argument("--num-requests", type=int, default=Plan.num_requests)
    parser.add_argument("--output-len", type=int, default=Plan.output_len)
    args = parser.parse_args(argv)
    plan = Plan(preset=args.preset, num_requests=args.num_requests, output_len=args.output_len)
    start = time.perf_counter()
    document: dict[str, Any] = {"machine": machine(), "plan": asdict(plan)}
    with tempfile.TemporaryDirectory() as model_dir:
        model = build_checkpoint(plan.preset, model_dir, plan.seed)
        document["sluice"], document["transformers"] = throughput_runs(plan, model_dir, model)
        document["decode_itl"] = decode_itl_runs(plan, model_dir)
    document["effects"] = effects(document)
    document["machine"]["load_average_at_end"] = os.getloadavg()
    document["seconds"] = time.perf_counter() - start
    print_report(document)
    for path in write_outputs(args.out, document):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
