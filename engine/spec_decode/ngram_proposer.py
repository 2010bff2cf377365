"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's
last n tokens (n from ngram_max down to ngram_min), anywhere in the prompt + output.

    tokens:   ... a b c d e ... x a b c   <- suffix "a b c" (n = 3)
                  ^ match    k = 2 -> propose "d e"
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sluice.engine.config import SpeculativeConfig
from sluice.engine.request import Request
from sluice.engine.spec_decode.proposer import Proposal


class NgramProposer:
    """Stateless; deterministic drafts (no q distribution)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.ngram_min = config.ngram_min
        self.ngram_max = config.ngram_max

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        proposals = {}
        for request in requests:
            token_ids = propose_ngram(request.all_token_ids, self.ngram_min, self.ngram_max, self.k)
            if token_ids:
                proposals[request.request_id] = Proposal(tuple(token_ids))
        return proposals

    def free(self, request_ids: Iterable[str]) -> None:
        pass


def propose_ngram(tokens: Sequence[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest suffix of `tokens` (length
    ngram_max down to ngram_min) that occurs before; [] when none does."""
    num_tokens = len(tokens)
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        suffix = list(tokens[num_tokens - n :])
        first = suffix[0]
        # A match starts at i < num_tokens - n and must be followed by at least one token.
        for i in range(num_tokens - n - 1, -1, -1):
            if tokens[i] == first and list(tokens[i : i + n]) == suffix:
                return list(tokens[i + n : i + n + k])
    return []
