"""Time per output token of offline completions, as the engine benchmarks report it."""

from __future__ import annotations

import math
import statistics

from sluice.engine.frontend.llm import Completion


def tpot_ms(completions: list[Completion]) -> float:
    """Mean over requests of (last token time - first token time) / (tokens - 1), in milliseconds.
    One-token completions (an EOS first) have no time per output token; NaN when none has more."""
    per_request = [
        (c.timings.finished - c.timings.first_token) / (len(c.token_ids) - 1)
        for c in completions
        if len(c.token_ids) > 1
    ]
    return 1000 * statistics.mean(per_request) if per_request else math.nan
