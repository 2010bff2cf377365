"""Seeded workloads: what each benchmark request asks for, as token ids with an exact output length.

Prompts are token ids (the server may serve a random-weight model with no tokenizer) and requests set
ignore_eos, so every request produces exactly `output_len` tokens. Request `i` of a workload depends only
on (seed, i), so a run of any length, by count or by duration, replays the same requests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

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
        if self.sigma < 0:
            raise ValueError("sigma: must be >= 0")
        if self.prefix_len < 0:
            raise ValueError("prefix_len: must be >= 0")

    def request(self, index: int) -> BenchRequest:
        """Request number `index`: a pure function of (seed, index)."""
        rng = random.Random(f"{self.seed}:{index}")
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
