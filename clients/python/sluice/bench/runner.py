"""Asyncio load generation: send a workload's requests through a transport and time every chunk.

Arrivals follow a Poisson process at `request_rate` (infinite: all at once); `concurrency` caps the
requests in flight. With an infinite rate and a concurrency of N this is a closed loop: N requests in
flight, a new one sent as soon as one finishes. The run stops sending after `num_requests` or after
`duration` seconds, then waits for the requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sluice.bench.metrics import RequestRecord, RunMetrics, Slo, summarize
from sluice.bench.transports import BenchError, Transport
from sluice.bench.workloads import BenchRequest, Workload, poisson_arrival_times

ProgressCallback = Callable[[int, int, float], None]  # (finished, sent, elapsed seconds)


@dataclass(frozen=True)
class LoadConfig:
    num_requests: int | None = None
    duration: float | None = None  # seconds of sending
    request_rate: float = math.inf  # requests / s
    concurrency: int | None = None  # cap on requests in flight
    warmup_requests: int = 1  # sent one by one before the clock starts, not counted

    def __post_init__(self) -> None:
        # Float checks are written `not x > 0` so that NaN, which fails every comparison, fails them.
        if (self.num_requests is None) == (self.duration is None):
            raise ValueError("num_requests: give exactly one of num_requests and duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests: must be >= 1")
        if self.duration is not None and not self.duration > 0:
            raise ValueError("duration: must be > 0")
        if not self.request_rate > 0:
            raise ValueError("request_rate: must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency: must be >= 1")
        if self.duration is not None and math.isinf(self.request_rate) and self.concurrency is None:
            raise ValueError("duration: needs a finite request_rate or a concurrency")
        if self.warmup_requests < 0:
            raise ValueError("warmup_requests: must be >= 0")


@dataclass
class RunResult:
    metrics: RunMetrics
    records: list[RequestRecord]


async def run_load(
    transport: Transport,
    workload: Workload,
    load: LoadConfig,
    *,
    slo: Slo | None = None,
    progress: ProgressCallback | None = None,
) -> RunResult:
    """Runs the load and returns the metrics and every request's timeline (clock: run start = 0)."""
    run_id = uuid.uuid4().hex[:8]
    await warm_up(transport, workload, load.warmup_requests, run_id)
    return await _LoadRun(transport, load, run_id, progress).run(workload, slo or Slo())


async def warm_up(transport: Transport, workload: Workload, num_requests: int, run_id: str = "") -> None:
    """Sends the workload's warm-up requests one by one, untimed (prompts no timed request repeats)."""
    run_id = run_id or uuid.uuid4().hex[:8]
    for i in range(num_requests):
        record = RequestRecord(-1, 0, 0.0)
        await _send(transport, f"warmup-{run_id}-{i}", record, workload.warmup_request(i))


class _LoadRun:
    """One timed run: sends on schedule under the concurrency cap, then waits for what is in flight."""

    def __init__(
        self, transport: Transport, load: LoadConfig, run_id: str, progress: ProgressCallback | None
    ) -> None:
        self.transport, self.load, self.run_id, self.progress = transport, load, run_id, progress
        self.records: list[RequestRecord] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.limit = asyncio.Semaphore(load.concurrency or 2**31)
        self.num_finished = 0
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def out_of_time(self) -> bool:
        return self.load.duration is not None and self.elapsed() >= self.load.duration

    async def run(self, workload: Workload, slo: Slo) -> RunResult:
        self.start = time.perf_counter()
        arrivals = poisson_arrival_times(self.load.request_rate, workload.seed)
        requests = workload.requests(self.load.num_requests)
        duration = self.load.duration
        for index, (request, send_at) in enumerate(zip(requests, arrivals, strict=False)):
            if self.out_of_time() or (duration is not None and send_at >= duration):
                break  # not sleeping to an arrival past the deadline (minutes at a low --request-rate)
            if (delay := send_at - self.elapsed()) > 0:
                await asyncio.sleep(delay)
            await self.limit.acquire()
            now = self.elapsed()  # read once: a request recorded as sent is one sent before the deadline
            if duration is not None and now >= duration:
                self.limit.release()
                break
            self.launch(index, request, now)
        if self.tasks:
            await asyncio.wait(set(self.tasks))
        # The run's wall time: from its start (the first send) until every request has ended, the failed
        # ones too (vLLM's benchmark duration); the last success alone would leave out a late failure.
        duration = self.elapsed()
        return RunResult(summarize(self.records, max(duration, 1e-9), slo), self.records)

    def launch(self, index: int, request: BenchRequest, at: float) -> None:
        record = RequestRecord(index, len(request.prompt_token_ids), at)
        self.records.append(record)
        request_id = f"bench-{self.run_id}-{index}"
        task = asyncio.create_task(_send(self.transport, request_id, record, request, self.start))
        self.tasks.add(task)
        task.add_done_callback(self.finished)

    def finished(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.limit.release()
        self.num_finished += 1
        if self.progress is not None:
            self.progress(self.num_finished, len(self.records), self.elapsed())


async def _send(
    transport: Transport, request_id: str, record: RequestRecord, request: BenchRequest, start: float = 0.0
) -> None:
    """Streams one request, stamping each token-carrying chunk and the end on `record` (clock: start),
    and the prefix-cache counts the last chunk reports. The end is the arrival of the last chunk, as
    vLLM's benchmark times it: not the call's close, which waits for the server's trailers."""
    try:
        last = None
        async for chunk in transport.generate(request_id, request):
            last = time.perf_counter() - start
            if chunk.num_tokens:
                record.chunk_times.append(last)
                record.num_output_tokens += chunk.num_tokens
            if chunk.cached_tokens is not None:
                record.cached_tokens = chunk.cached_tokens
            if chunk.prompt_tokens_computed is not None:
                record.prompt_tokens_computed = chunk.prompt_tokens_computed
        record.end = time.perf_counter() - start if last is None else last
    except BenchError as error:
        record.error = error.code
    except Exception as error:  # a benchmark reports failures; it does not stop at the first
        record.error = type(error).__name__


def run_load_sync(
    transport_factory: Callable[[], Transport], workload: Workload, load: LoadConfig, **kwargs
) -> RunResult:
    """`run_load` on a fresh event loop; the transport is made on that loop and closed after."""

    async def main() -> RunResult:
        transport = transport_factory()
        try:
            return await run_load(transport, workload, load, **kwargs)
        finally:
            with contextlib.suppress(Exception):
                await transport.close()

    return asyncio.run(main())
