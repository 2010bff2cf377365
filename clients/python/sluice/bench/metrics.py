"""Serving metrics from per-request timelines, defined as serving engines are measured.

For one request sent at `start`, with token-carrying chunks received at t_1 < t_2 < ... < t_k and its
last chunk (the one that finishes it) at `end`, having produced n_out tokens:

    TTFT  = t_1 - start                       time to first token
    E2E   = end - start                       end-to-end latency
    TPOT  = (E2E - TTFT) / (n_out - 1)        time per output token after the first (n_out > 1 only)
    ITL   = t_{j+1} - t_j for every j         inter-token latency: every gap between chunks, pooled

Throughputs divide by the run's wall time (until its last request ended, failed or not). Goodput counts
the successful requests whose TTFT and TPOT both meet the SLOs given (an SLO left None always holds; a
one-token request has no TPOT to miss).

Prompt tokens split, as the server counts them, into those served from its prefix cache and those it
computed. A request served more from the cache than its workload shares by design (`unexpected_cache_hits`)
repeats a prompt the server has seen: its TTFT and throughput measure the cache, not the engine.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """The timeline of one request, in seconds on one monotonic clock."""

    index: int
    prompt_len: int
    start: float
    chunk_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    end: float | None = None
    error: str | None = None  # a status code name, e.g. "RESOURCE_EXHAUSTED"; None on success
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (server's count)
    prompt_tokens_computed: int | None = None  # prompt tokens the server ran through the model

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        assert self.end is not None
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile: no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in seconds; every field None when there were no samples."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, None, None, None, None)
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(len(values), math.fsum(values) / len(values), p50, p90, p99)


@dataclass(frozen=True)
class Slo:
    ttft: float | None = None  # seconds
    tpot: float | None = None  # seconds

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # NaN fails it too
                raise ValueError(f"slo_{name}: must be > 0")

    def met_by(self, record: RequestRecord) -> bool:
        tpot = record.tpot
        ttft_ok = self.ttft is None or record.ttft <= self.ttft
        tpot_ok = self.tpot is None or tpot is None or tpot <= self.tpot
        return ttft_ok and tpot_ok


@dataclass(frozen=True)
class RunMetrics:
    num_requests: int
    num_completed: int
    errors: dict[str, int]  # status code name -> count
    duration_seconds: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens of completed requests) / s
    goodput: float | None  # completed requests meeting the SLO / s; None without an SLO
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    # Over completed requests, as the server reports them (None: it reported none).
    cached_prompt_tokens: int | None = None
    computed_prompt_tokens: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunMetrics:
        latencies = {name: Distribution(**data[name]) for name in ("ttft", "tpot", "itl", "e2e")}
        return cls(**(data | latencies))


def summarize(
    records: Sequence[RequestRecord], duration_seconds: float, slo: Slo | None = None
) -> RunMetrics:
    """Aggregates request timelines from a run that took `duration_seconds` of wall time."""
    if duration_seconds <= 0:
        raise ValueError("duration_seconds: must be > 0")
    slo = slo or Slo()
    done = [r for r in records if r.ok]
    errors = Counter(r.error or "INCOMPLETE" for r in records if not r.ok)
    prompt_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    has_slo = slo.ttft is not None or slo.tpot is not None
    return RunMetrics(
        num_requests=len(records),
        num_completed=len(done),
        errors=dict(sorted(errors.items())),
        duration_seconds=duration_seconds,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_throughput=len(done) / duration_seconds,
        output_throughput=output_tokens / duration_seconds,
        total_token_throughput=(prompt_tokens + output_tokens) / duration_seconds,
        goodput=sum(slo.met_by(r) for r in done) / duration_seconds if has_slo else None,
        ttft=Distribution.of([r.ttft for r in done]),
        tpot=Distribution.of([t for r in done if (t := r.tpot) is not None]),
        itl=Distribution.of([gap for r in done for gap in r.itls]),
        e2e=Distribution.of([r.e2e for r in done]),
        cached_prompt_tokens=_reported_sum([r.cached_tokens for r in done]),
        computed_prompt_tokens=_reported_sum([r.prompt_tokens_computed for r in done]),
    )


def unexpected_cache_hits(records: Sequence[RequestRecord], shared_prefix_len: int) -> int:
    """How many requests the prefix cache served more prompt tokens than the `shared_prefix_len` their
    workload shares by design (0 unless it asks for a shared prefix)."""
    return sum(r.cached_tokens is not None and r.cached_tokens > shared_prefix_len for r in records)


def _reported_sum(values: Sequence[int | None]) -> int | None:
    reported = [v for v in values if v is not None]
    return sum(reported) if reported else None
