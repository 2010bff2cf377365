"""Seeded workloads: what each benchmark request asks for, as token ids with an exact output length.

Prompts are token ids (the server may serve a random-weight model with no tokenizer) and requests set
ignore_eos, so every request produces exactly `output_len` tokens. Request `i` of a workload depends only
on (seed, i), so a run of any length, by count or by duration, replays the same requests.

A server's prefix cache serves any prompt it has seen, so a benchmark must not show it one twice unless
the workload asks for that: each run of a sweep draws its prompts with its own seed (`for_run`, from the
sweep's seed and the run's index), and its warm-up requests come from a stream of their own
(`warmup_request`). Only the shared-prefix workload's system prompt is shared, within a run and with
its warm-up (`shared_prefix_len`): that sharing is what it measures.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

# Token ids below this are left out of prompts: they are the special tokens of most vocabularies.
FIRST_PROMPT_TOKEN = 3


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int


@dataclass(frozen=True)
class Workload:
    """A seeded, endless stream of requests; `kind` picks the length distribution.

    kind "fixed":  every prompt has `input_len` tokens, every output `output_len`.
    kind "chat":   log-normal prompt and output lengths with medians `input_len` / `output_len` and
                   shape `sigma`, clipped to [1, max_input_len] / [1, max_output_len].
    kind "shared-prefix": one `prefix_len`-token system prompt shared by all requests, followed by a
                   unique `input_len`-token suffix; outputs of `output_len` tokens.
    """

    kind: str
    vocab_size: int
    seed: int = 0
    input_len: int = 128
    output_len: int = 128
    sigma: float = 0.8
    max_input_len: int = 2048
    max_output_len: int = 1024
    prefix_len: int = 1024

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload: must be one of {WORKLOAD_KINDS}, got {self.kind!r}")
        if self.vocab_size <= FIRST_PROMPT_TOKEN:
            raise ValueError(f"vocab_size: must be > {FIRST_PROMPT_TOKEN}")
        for name in ("input_len", "output_len", "max_input_len", "max_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if not self.sigma >= 0:  # NaN fails it too
            raise ValueError("sigma: must be >= 0")
        if self.prefix_len < 0:
            raise ValueError("prefix_len: must be >= 0")

    @property
    def shared_prefix_len(self) -> int:
        """Prompt tokens every request of a run (and its warm-up) shares by design: the most the prefix
        cache may serve a request without the run measuring the cache instead of the engine."""
        return self.prefix_len if self.kind == "shared-prefix" else 0

    def for_run(self, run_index: int) -> Workload:
        """This workload for run `run_index` of a sweep: the same shape, prompts of its own."""
        return replace(self, seed=run_seed(self.seed, run_index))

    def request(self, index: int) -> BenchRequest:
        """Request number `index`: a pure function of (seed, index)."""
        return self._draw(random.Random(f"{self.seed}:{index}"))

    def warmup_request(self, index: int) -> BenchRequest:
        """Warm-up request number `index`: the workload's shape, two output tokens, a prompt from a
        stream apart from the timed requests' (with a shared prefix, the run's: warm as in steady state)."""
        return replace(self._draw(random.Random(f"{self.seed}:warm-up:{index}")), output_len=2)

    def _draw(self, rng: random.Random) -> BenchRequest:
        if self.kind == "fixed":
            return BenchRequest(self._tokens(rng, self.input_len), self.output_len)
        if self.kind == "chat":
            num_in = _log_normal(rng, self.input_len, self.sigma, self.max_input_len)
            num_out = _log_normal(rng, self.output_len, self.sigma, self.max_output_len)
            return BenchRequest(self._tokens(rng, num_in), num_out)
        prefix = self._tokens(random.Random(f"{self.seed}:prefix"), self.prefix_len)
        return BenchRequest(prefix + self._tokens(rng, self.input_len), self.output_len)

    def requests(self, num_requests: int | None = None) -> Iterator[BenchRequest]:
        """Requests 0, 1, 2, ...; endless when `num_requests` is None."""
        index = 0
        while num_requests is None or index < num_requests:
            yield self.request(index)
            index += 1

    def _tokens(self, rng: random.Random, num_tokens: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_PROMPT_TOKEN, self.vocab_size) for _ in range(num_tokens))


WORKLOAD_KINDS = ("fixed", "chat", "shared-prefix")


def run_seed(seed: int, run_index: int) -> int:
    """The seed of run `run_index` of a sweep seeded `seed`: a 63-bit hash of both, so every run draws
    its own prompts and the same (seed, run_index) draws the same ones again."""
    if run_index < 0:
        raise ValueError(f"run_index: must be >= 0, got {run_index}")
    digest = hashlib.sha256(f"sluice bench run {run_index} of seed {seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _log_normal(rng: random.Random, median: int, sigma: float, upper: int) -> int:
    """A log-normal draw with the given median (exp(mu) = median), rounded and clipped to [1, upper]."""
    return min(upper, max(1, round(rng.lognormvariate(math.log(median), sigma))))


def poisson_arrival_times(request_rate: float, seed: int) -> Iterator[float]:
    """Send times in seconds from the start: exponential gaps of mean 1/request_rate; all 0 when inf."""
    rng = random.Random(f"{seed}:arrivals")
    now = 0.0
    while True:
        yield now
        if math.isfinite(request_rate):
            now += rng.expovariate(request_rate)
