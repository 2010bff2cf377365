"""`python -m sluice.benchmarks.engine.speculative`: every request and the warm-up is a conversation of its
own, so neither engine's prefix cache holds more of a prompt than the chat template they all share."""

from __future__ import annotations

import json
import math

import pytest

from sluice.benchmarks.engine import speculative as bench


def test_every_request_and_the_warm_up_is_a_conversation_of_its_own():
    conversations = [bench.grounded(i) for i in range(bench.MAX_REQUESTS)]
    conversations += [bench.chat(i) for i in range(bench.MAX_REQUESTS)] + [bench.WARM_UP]
    conversations += [bench.extraction(i) for i in range(bench.MAX_REQUESTS)]
    conversations += [bench.how_to(i) for i in range(bench.MAX_REQUESTS)]
    # the user's message is the only one, and they differ within their first 30 characters
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in conversations)
    assert len({c[0]["content"][:30] for c in conversations}) == len(conversations) == 33
    assert bench.grounded(5)[0]["content"].endswith(bench.PASSAGES[1])


def test_more_requests_than_distinct_conversations_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--requests", str(bench.MAX_REQUESTS + 1)])
    assert (
        "--requests: must be in [1, 8] (a repeated request is a prefix-cache hit)" in capsys.readouterr().err
    )


def test_one_request_of_one_token_each_is_measured_not_flagged(tmp_path, capsys):
    """A single request shares only the chat template's prefix with the warm-up: that hit was flagged (no
    second prompt to share it with); a one-token output divided by zero."""
    path = tmp_path / "spec.json"
    assert bench.main(["--requests", "1", "--max-tokens", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [row["cache_hits_unexpected"] for row in rows] == [False, False, False, False]
    assert all(row["cached_tokens_off"] > 0 for row in rows)  # the template's prefix, from the warm-up
    assert all(math.isnan(row["tpot_off_ms"]) for row in rows)  # no time per output token to measure
    assert "warning" not in capsys.readouterr().out
