"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's
last n tokens (n from ngram_max down to ngram_min), anywhere in the prompt + output.

    tokens:   ... a b c d e ... x a b c   <- suffix "a b c" (n = 3)
                  ^ match    k = 2 -> propose "d e"

The lookup runs every step for every speculating request over its whole context, so it is a vectorized
scan (numpy: n comparisons of the context against the suffix's tokens) over a copy of the request's tokens
that the proposer keeps and extends as the request grows, not a Python loop: at 32k tokens with no match
the loop took ~3 ms a request a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from sluice.engine.config import SpeculativeConfig
from sluice.engine.request import Request
from sluice.engine.spec_decode.proposer import Proposal


class NgramProposer:
    """Deterministic drafts (no q distribution). Holds each request's tokens as an array until `free`."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.ngram_min = config.ngram_min
        self.ngram_max = config.ngram_max
        self._tokens: dict[str, TokenArray] = {}

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        proposals = {}
        for request in requests:
            tokens = self._tokens.setdefault(request.request_id, TokenArray())
            tokens.sync(request.prompt_token_ids, request.output_token_ids)
            token_ids = propose_ngram(tokens.view(), self.ngram_min, self.ngram_max, self.k)
            if token_ids:
                proposals[request.request_id] = Proposal(tuple(token_ids))
        return proposals

    def free(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._tokens.pop(request_id, None)


class TokenArray:
    """A request's prompt + output tokens in a growing int64 array (capacity doubled as it fills); the
    request's token lists only ever grow, so each sync copies just the tokens added since the last."""

    def __init__(self) -> None:
        self._array = np.empty(0, dtype=np.int64)
        self._length = 0

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        num_prompt = len(prompt)
        new = list(prompt[self._length :]) + list(output[max(0, self._length - num_prompt) :])
        if not new:
            return
        end = self._length + len(new)
        if end > len(self._array):
            grown = np.empty(max(end, 2 * len(self._array)), dtype=np.int64)
            grown[: self._length] = self._array[: self._length]
            self._array = grown
        self._array[self._length : end] = new
        self._length = end

    def view(self) -> np.ndarray:
        return self._array[: self._length]


def propose_ngram(tokens: Sequence[int] | np.ndarray, ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest suffix of `tokens` (length
    ngram_max down to ngram_min) that occurs before; [] when none does."""
    tokens = np.asarray(tokens, dtype=np.int64)
    num_tokens = len(tokens)
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        start = _latest_match(tokens, n)
        if start >= 0:
            return tokens[start + n : start + n + k].tolist()
    return []


def _latest_match(tokens: np.ndarray, n: int) -> int:
    """The latest start i of the last n tokens' earlier occurrence that a token follows (i + n < len),
    or -1: match[i] holds while tokens[i + j] == suffix[j] for every j < n."""
    width = len(tokens) - n  # candidate starts 0 .. width - 1
    suffix = tokens[width:]
    match = tokens[:width] == suffix[0]
    for j in range(1, n):
        match &= tokens[j : j + width] == suffix[j]
    hits = np.flatnonzero(match)
    return int(hits[-1]) if hits.size else -1
