"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's
last n tokens (n from ngram_max down to ngram_min), anywhere in the prompt + output.

    tokens:   ... a b c d e ... x a b c   <- suffix "a b c" (n = 3)
                  ^ match    k = 2 -> propose "d e"

The lookup runs every step for every speculating request over its whole context, on a copy of the
request's tokens that the proposer keeps and extends as the request grows (a numpy array), never a Python
loop over the context (at 32k tokens with no match that took ~3 ms a request a step). One pass finds the
earlier positions of the last token, the ends of every candidate match; the latest few are then extended
one at a time, back along the suffix, stopping at the first that matches it all (ngram_max tokens), and
only where none does are the older ones extended together, each further suffix token keeping those it
extends. Scanning the whole context once per suffix token and per n, as before 2026-12-06, took 1.9-3.2x
as long on real text and 6-12x where the last token had not occurred before (docs/BENCHMARKS.md,
"Figures behind the code").
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


# The latest candidate matches checked one at a time (a Python loop, stopping at the first of the longest
# length possible) before the rest, if need be, are checked together (numpy): most lookups end in the first
# few, where a numpy call a suffix token cost more than the loop.
NUM_SCANNED = 8


def propose_ngram(tokens: Sequence[int] | np.ndarray, ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest suffix of `tokens` (length
    ngram_max down to ngram_min) that occurs before; [] when none does."""
    tokens = np.asarray(tokens, dtype=np.int64)
    num_tokens = len(tokens)
    if num_tokens < 2:
        return []
    # The ends of the earlier matches of the last token (a token follows each), ascending.
    ends = (tokens[: num_tokens - 1] == tokens[num_tokens - 1]).nonzero()[0]  # (flatnonzero's wrapper: +2 us)
    if not ends.size:
        return []
    longest = min(ngram_max, num_tokens - 1)
    suffix = tokens[num_tokens - longest :].tolist()
    latest, length = _latest_longest(tokens, ends[-NUM_SCANNED:].tolist(), suffix)
    if length < longest and ends.size > NUM_SCANNED:
        older, older_length = _latest_longest_of_many(tokens, ends[:-NUM_SCANNED], suffix)
        if older_length > length:
            latest, length = older, older_length
    if length < ngram_min:
        return []
    return tokens[latest + 1 : latest + 1 + k].tolist()


def _latest_longest(tokens: np.ndarray, ends: list[int], suffix: list[int]) -> tuple[int, int]:
    """(end, length) of the longest match of the suffix's last tokens (up to all of `suffix`) among those
    ending at `ends` (ascending), the latest of that length."""
    longest = len(suffix)
    best, best_length = -1, 0
    for end in reversed(ends):
        length = 1  # the last token matches at every end
        while length < longest and length <= end and tokens[end - length] == suffix[-1 - length]:
            length += 1
        if length > best_length:
            best, best_length = end, length
            if length == longest:
                break
    return best, best_length


def _latest_longest_of_many(tokens: np.ndarray, ends: np.ndarray, suffix: list[int]) -> tuple[int, int]:
    """`_latest_longest` over many ends at once: each further suffix token keeps the ends it extends."""
    latest, length = int(ends[-1]), 1
    for j in range(1, len(suffix)):
        if ends[0] < j:  # a match of j + 1 tokens cannot end before position j
            ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == suffix[-1 - j]]
        if not ends.size:
            break
        latest, length = int(ends[-1]), j + 1
    return latest, length
