"""`sluice bench`'s timings against vLLM's benchmark_serving definitions: a request's end-to-end latency
ends at its last chunk (not at the call's close), and a run's wall time ends when its last request ends,
failed ones included (vLLM's `benchmark_duration`). Metrics cross-checked on random timelines against a
computation written out from vLLM's `calculate_metrics` definitions."""

from __future__ import annotations

import asyncio
import random

import numpy
import pytest
from service_harness import ServerThread, bench_load, tiny_engine_config

from sluice.bench.metrics import RequestRecord, Slo, summarize
from sluice.bench.runner import LoadConfig, run_load
from sluice.bench.transports import BenchError, Chunk, GenerateTransport, StreamTransport
from sluice.bench.workloads import Workload


class _LateFailure:
    """Requests 0-2 stream two one-token chunks at once; request 3 fails 10 ms after the others ended."""

    def __init__(self) -> None:
        self.num_done = 0
        self.others_done = asyncio.Event()

    async def generate(self, request_id, request):
        if request_id.endswith("-3"):
            await self.others_done.wait()
            await asyncio.sleep(0.01)
            raise BenchError("DEADLINE_EXCEEDED")
        yield Chunk(1)
        yield Chunk(1, cached_tokens=0, prompt_tokens_computed=len(request.prompt_token_ids))
        self.num_done += 1
        if self.num_done == 3:
            self.others_done.set()

    async def close(self) -> None:
        pass


async def test_the_runs_wall_time_counts_a_request_that_failed_after_the_last_success() -> None:
    load = LoadConfig(num_requests=4, warmup_requests=0)
    result = await run_load(_LateFailure(), Workload("fixed", 100, input_len=4, output_len=2), load)
    m = result.metrics
    assert (m.num_requests, m.num_completed, m.errors, m.output_tokens) == (4, 3, {"DEADLINE_EXCEEDED": 1}, 6)
    last_success = max(r.end for r in result.records if r.ok)
    # vLLM divides by the wall time until every request returned; the late failure is part of the run
    assert m.duration_seconds >= last_success + 0.01
    assert m.request_throughput == pytest.approx(3 / m.duration_seconds)
    assert m.output_throughput == pytest.approx(6 / m.duration_seconds)


class _SlowClose:
    """Three one-token chunks, then 20 ms before the call ends (the server's trailers)."""

    async def generate(self, request_id, request):
        for i in range(3):
            await asyncio.sleep(0)
            yield Chunk(1) if i < 2 else Chunk(1, cached_tokens=0, prompt_tokens_computed=4)
        await asyncio.sleep(0.02)

    async def close(self) -> None:
        pass


async def test_e2e_and_tpot_end_at_the_last_chunk_not_at_the_calls_close() -> None:
    load = LoadConfig(num_requests=2, warmup_requests=0)
    result = await run_load(_SlowClose(), Workload("fixed", 100, input_len=4, output_len=3), load)
    for record in result.records:
        assert record.ok and record.num_output_tokens == 3
        # vLLM: latency = most_recent_timestamp - st, the last chunk; TPOT = (latency - ttft) / (n - 1)
        assert record.end == record.chunk_times[-1]
        assert record.tpot == pytest.approx(sum(record.itls) / 2)
    assert result.metrics.cached_prompt_tokens == 0 and result.metrics.computed_prompt_tokens == 8


@pytest.fixture(scope="module")
def server(llama_dir: str):
    thread = ServerThread(tiny_engine_config(llama_dir)).start()
    yield thread
    thread.stop()


@pytest.mark.parametrize(("transport", "seed"), [(GenerateTransport, 1), (StreamTransport, 2)])
def test_against_a_server_e2e_is_the_last_chunks_arrival(server: ServerThread, transport, seed: int) -> None:
    workload = Workload("fixed", 128, seed=seed, input_len=20, output_len=5)  # prompts of its own
    result = bench_load(server.target, workload, LoadConfig(num_requests=4, concurrency=2), transport)
    assert result.metrics.num_completed == 4
    for record in result.records:
        assert record.num_output_tokens == 5
        assert record.e2e == record.chunk_times[-1] - record.start
        assert record.tpot == pytest.approx((record.chunk_times[-1] - record.chunk_times[0]) / 4)
        # the server's count, reported: 20 fresh tokens (one whole block of 16 at most could be cached)
        assert (record.cached_tokens, record.prompt_tokens_computed) == (0, 20)


def _vllm_metrics(records: list[RequestRecord], dur_s: float, slo_ttft: float, slo_tpot: float) -> dict:
    """The figures as vLLM's benchmark_serving `calculate_metrics` defines them, written out (seconds)."""
    actual_output_lens, total_input, completed, good = [], 0, 0, 0
    itls, tpots, all_tpots, ttfts, e2els = [], [], [], [], []
    for r in records:
        if r.error is None and r.end is not None and r.chunk_times:
            output_len = r.num_output_tokens
            actual_output_lens.append(output_len)
            total_input += r.prompt_len
            ttft, latency = r.chunk_times[0] - r.start, r.end - r.start
            tpot = 0
            if output_len > 1:
                tpot = (latency - ttft) / (output_len - 1)
                tpots.append(tpot)
            all_tpots.append(tpot)
            itls += [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
            ttfts.append(ttft)
            e2els.append(latency)
            completed += 1
        else:
            actual_output_lens.append(0)
    good = sum(t <= slo_ttft and p <= slo_tpot for t, p in zip(ttfts, all_tpots, strict=True))
    return {
        "completed": completed,
        "request_throughput": completed / dur_s,
        "output_throughput": sum(actual_output_lens) / dur_s,
        "total_token_throughput": (total_input + sum(actual_output_lens)) / dur_s,
        "goodput": good / dur_s,
        **{
            name: (numpy.mean(v), *(numpy.percentile(v, p) for p in (50, 90, 99)))
            for name, v in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2e", e2els))
            if v
        },
    }


def _random_timeline(rng: random.Random, num_requests: int) -> list[RequestRecord]:
    records = []
    for i in range(num_requests):
        start = rng.uniform(0, 5)
        record = RequestRecord(i, rng.randint(1, 300), start)
        kind = rng.random()
        if kind < 0.1:  # rejected before any token
            record.error = "RESOURCE_EXHAUSTED"
        else:
            now, num_chunks = start, rng.choice([1, 1, 2, 5, 20])
            for _ in range(num_chunks):
                now += rng.expovariate(20)
                record.chunk_times.append(now)
                record.num_output_tokens += rng.choice([1, 1, 1, 3])  # some chunks carry several tokens
            if kind < 0.2:  # aborted mid-stream
                record.error = "FINISH_REASON_ABORT"
            elif kind > 0.95:  # cut off: no end
                pass
            else:
                record.end = now
        records.append(record)
    return records


@pytest.mark.parametrize("seed", range(20))
def test_metrics_match_vllms_calculate_metrics_on_random_timelines(seed: int) -> None:
    rng = random.Random(seed)
    records = _random_timeline(rng, rng.randint(3, 60))
    dur_s, slo = rng.uniform(5, 10), Slo(ttft=rng.uniform(0.02, 0.2), tpot=rng.uniform(0.02, 0.1))
    m, ref = summarize(records, dur_s, slo), _vllm_metrics(records, dur_s, slo.ttft, slo.tpot)
    assert m.num_completed == ref["completed"]
    for name in ("request_throughput", "output_throughput", "total_token_throughput", "goodput"):
        assert getattr(m, name) == pytest.approx(ref[name], rel=1e-12, abs=1e-12), name
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = getattr(m, name)
        if d.count:
            assert (d.mean, d.p50, d.p90, d.p99) == pytest.approx(ref[name], rel=1e-9), name
