"""Long stop strings cost nothing up front. The frontend builds a request's StopStringMatcher on the event
loop that streams every request; building each stop string's whole KMP fallback table there held that loop
(every stream of the server) for 12-21 s for a request of 32 stop strings of 1 MB, before its first token.
The table now grows only as far as the output's partial matches reach, so the work is per character of
output, and the matches are the same (checked against a plain search)."""

from __future__ import annotations

import random

import pytest

from sluice.engine.text.stop_strings import StopStringMatcher

pytestmark = pytest.mark.timeout(120)


class CountedStr(str):
    """A stop string that counts the characters read from it one at a time."""

    reads = 0

    def __getitem__(self, key):
        CountedStr.reads += 1
        return str.__getitem__(self, key)


def test_a_matcher_of_long_stop_strings_reads_them_only_as_far_as_the_output_matches() -> None:
    stops = [CountedStr(chr(ord("a") + i) * 1_000_000 + str(i)) for i in range(4)]
    CountedStr.reads = 0
    matcher = StopStringMatcher(stops)
    assert CountedStr.reads == 0  # was 4,000,000: every table built whole
    text = "b" * 500 + "xyz " * 100
    assert matcher.push(text[:300]) == ""  # all 300 may still begin the "b" stop string
    assert matcher.push(text[300:]) == text
    # A few reads per stop string per character pushed, however long the stop strings.
    assert CountedStr.reads <= 4 * len(stops) * len(text)


def _first_stop(pushed: str, stops: list[str]) -> str | None:
    """The stop string a matcher fed `pushed` piece by piece matches once its last piece is in, by a plain
    search (no stop string is in the text before that piece): the one that starts first, on a tie the one
    listed first."""
    found = [(pushed.find(stop), i) for i, stop in enumerate(stops) if stop in pushed]
    return stops[min(found)[1]] if found else None


@pytest.mark.parametrize("seed", range(200))
def test_matches_equal_a_plain_search(seed: int) -> None:
    rng = random.Random(seed)
    stops = ["".join(rng.choices("ab", k=rng.randint(1, 12))) for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choices("ab", k=rng.randint(0, 60)))
    matcher = StopStringMatcher(stops)
    emitted, at, expected = [], 0, None
    while at < len(text) and expected is None:
        size = rng.randint(1, 5)
        emitted.append(matcher.push(text[at : at + size]))
        at += size
        expected = _first_stop(text[:at], stops)
        assert matcher.matched == expected
    emitted.append(matcher.flush())
    pushed = text[:at]
    assert "".join(emitted) == (pushed if expected is None else pushed[: pushed.find(expected)])
