"""The ratios `make bench` reports, and its terminal tables (see baselines.py for the runs)."""

from __future__ import annotations

from typing import Any

from sluice.bench.report import cache_warning


def _by_label(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {run["label"]: run for run in runs}


def throughput(run: dict[str, Any]) -> float:
    """Output tokens / s of a Sluice run document or a transformers baseline row."""
    return run["metrics"]["output_throughput"] if "metrics" in run else run["output_throughput"]


def effects(document: dict[str, Any]) -> dict[str, float]:
    """Each feature's effect as a ratio: throughputs as Sluice / other, latencies as without / with."""
    sluice = _by_label(document["sluice"])
    base = sluice["sluice gRPC"]
    hf_sequential, hf_static = document["transformers"]
    no_cache = sluice["sluice gRPC, prefix caching off"]
    no_chunk = sluice["sluice gRPC, chunked prefill off"]
    in_process = sluice["sluice in-process"]
    chunk_on, chunk_off = (run["metrics"]["itl"] for run in document["decode_itl"])
    grpc_vs_in_process = throughput(base) / throughput(in_process)
    return {
        "throughput_vs_transformers_sequential": throughput(base) / throughput(hf_sequential),
        "throughput_vs_transformers_static_batch": throughput(base) / throughput(hf_static),
        "throughput_prefix_caching_on_vs_off": throughput(base) / throughput(no_cache),
        "ttft_mean_prefix_caching_off_vs_on": no_cache["metrics"]["ttft"]["mean"]
        / base["metrics"]["ttft"]["mean"],
        "throughput_chunked_prefill_on_vs_off": throughput(base) / throughput(no_chunk),
        "decode_itl_p99_ms_chunked_prefill_on": chunk_on["p99"] * 1e3,
        "decode_itl_p99_ms_chunked_prefill_off": chunk_off["p99"] * 1e3,
        "decode_itl_p99_chunked_prefill_off_vs_on": chunk_off["p99"] / chunk_on["p99"],
        "throughput_grpc_vs_in_process": grpc_vs_in_process,
        "grpc_overhead_percent": (1 - grpc_vs_in_process) * 100,
    }


def _ms(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value * 1e3:>10.1f}"


def _cached(run: dict[str, Any]) -> str:
    """A Sluice run's prompt tokens served from the prefix cache, "!" when beyond the shared prefix."""
    cached = run.get("metrics", {}).get("cached_prompt_tokens")
    return "-" if cached is None else f"{cached}{'!' if run.get('cache_hits_unexpected') else ''}"


def throughput_table(document: dict[str, Any]) -> str:
    base = throughput(_by_label(document["sluice"])["sluice gRPC"])
    lines = [
        f"{'run':<36}{'seconds':>9}{'tok/s':>9}{'req/s':>8}{'TTFT mean':>10}{'TTFT p99':>10}"
        f"{'cached':>8}{'sluice/this':>13}"
    ]
    for run in document["sluice"] + document["transformers"]:
        m = run.get("metrics")
        seconds = m["duration_seconds"] if m else run["seconds"]
        requests = m["request_throughput"] if m else run["request_throughput"]
        ttft = _ms(m["ttft"]["mean"]) + _ms(m["ttft"]["p99"]) if m else _ms(None) + _ms(None)
        ratio = base / throughput(run)
        lines.append(
            f"{run['label']:<36}{seconds:>9.2f}{throughput(run):>9.1f}{requests:>8.2f}{ttft}"
            f"{_cached(run):>8}{ratio:>12.2f}x"
        )
    return "\n".join(lines + [cache_warning(r) for r in document["sluice"] if r.get("cache_hits_unexpected")])


def decode_itl_table(document: dict[str, Any]) -> str:
    lines = [
        f"{'run':<34}{'ITL p50':>10}{'ITL p90':>10}{'ITL p99':>10}{'TPOT p99':>10}{'long TTFT':>11}"
        f"{'cached':>8}"
    ]
    warnings = []
    for run in document["decode_itl"]:
        itl, tpot = run["metrics"]["itl"], run["metrics"]["tpot"]
        long_ttft = run["long_prompts"]["ttft"]["mean"]
        counts = [m.get("cached_prompt_tokens") for m in (run["metrics"], run["long_prompts"])]
        cached = "-" if counts == [None, None] else str(sum(c or 0 for c in counts))
        if run.get("cache_hits_unexpected") or run.get("long_prompts_cache_hits_unexpected"):
            cached += "!"
            warnings.append(f"warning: {run['label']}: prompts hit the prefix cache, which none shares")
        lines.append(
            f"{run['label']:<34}{_ms(itl['p50'])}{_ms(itl['p90'])}{_ms(itl['p99'])}"
            f"{_ms(tpot['p99'])}{_ms(long_ttft)}{cached:>8}"
        )
    return "\n".join(lines + warnings)


def print_report(document: dict[str, Any]) -> None:
    plan, machine = document["plan"], document["machine"]
    print(
        f"\nmachine: {machine['platform']}, {machine['cpu_count']} CPUs, torch {machine['torch']}, "
        f"cuda {machine['cuda']}, load average {machine['load_average_at_start'][0]:.2f} at start, "
        f"{machine['load_average_at_end'][0]:.2f} at end; {document['seconds']:.0f}s in all"
    )
    print(
        f"\nThroughput: {plan['num_requests']} requests sent at once, each a {plan['prefix_len']}-token "
        f"shared system prompt + {plan['input_len']} unique tokens, {plan['output_len']} output tokens "
        f"(latencies in ms)"
    )
    print(throughput_table(document))
    print(
        f"\nDecode latency while {plan['num_long_prompts']} prompts of {plan['long_prompt_len']} tokens "
        f"arrive ({plan['num_decodes']} requests decoding {plan['decode_output_len']} tokens; "
        f"chunked prefill on: token budget {plan['chunk_budget']}; ms)"
    )
    print(decode_itl_table(document))
    print("\nEffects")
    for name, value in document["effects"].items():
        print(f"  {name:<45}{value:>9.2f}")
