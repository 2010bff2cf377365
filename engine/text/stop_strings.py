"""Finds stop strings in streamed text, holding back only what could still become one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text pieces with `push`; it returns what is safe to emit.

    Invariant: the held-back text is the longest suffix of the unemitted text that is a proper prefix of some
    stop string, so at most (longest stop string - 1) characters are held, and a stop string that spans
    several pieces is still found. Once `matched` is set, the text from the stop string on is dropped.
    Each stop string's partial match is carried from piece to piece (Knuth-Morris-Pratt), so a piece costs
    its own length, however long the stop strings and the held text (a rescan of the held text at each
    piece cost its square: seconds on the event loop for a 300k-character stop string). Each stop string's
    fallback table grows only as far as a partial match has reached, so a matcher costs nothing per
    character of its stop strings up front (built whole, 32 stop strings of 1 MB held the event loop, and
    every stream on it, for 12 s before the request's first token).

    `include` (vLLM's include_stop_str_in_output): the stop string is emitted too, and only what follows it
    is dropped; nothing is held back (a stop string is looked for across the last pieces already emitted).
    """

    def __init__(self, stop_strings: Sequence[str], include: bool = False) -> None:
        self.stop_strings = tuple(stop_strings)
        self.matched: str | None = None
        self._held = ""
        self._include = include
        self._emitted_tail = ""  # with `include`: the emitted text a stop string may have begun in
        self._tail_len = max(map(len, self.stop_strings), default=1) - 1
        self._fallbacks: list[list[int]] = [[] for _ in self.stop_strings]  # grown by _advance_partials
        self._partials = [0] * len(self.stop_strings)  # per stop string: how much of it the text ends with

    def push(self, text: str, match: bool = True) -> str:
        """Append `text`; return the newly emittable text (empty once a stop string matched).

        Only a stop string that ends in `text` matches, and none with `match` False (the text of a request's
        first min_tokens tokens: what may begin a stop string is still held back, as a stop string that
        ends in later text may start in it)."""
        if self.matched is not None:
            return ""
        if self._include:
            return self._push_included(text, match)
        pending = self._held + text
        if not self.stop_strings:
            return pending
        stop_at, stop = self._first_match(pending, len(self._held)) if match else (0, None)
        if stop is not None:
            self.matched = stop
            self._held = ""
            return pending[:stop_at]
        keep = self._advance_partials(text)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def _push_included(self, text: str, match: bool) -> str:
        window = self._emitted_tail + text
        tail_len = len(self._emitted_tail)
        stop_at, stop = self._first_match(window, tail_len) if match else (0, None)
        if stop is not None:
            self.matched = stop
            return window[tail_len : stop_at + len(stop)]
        self._emitted_tail = window[max(len(window) - self._tail_len, 0) :]
        return text

    def flush(self) -> str:
        """Release the held-back text (the stream ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str, num_held: int) -> tuple[int, str | None]:
        # Earliest occurrence that ends after the held text wins; on a tie, the stop string listed first.
        best_at, best = len(text), None
        for stop in self.stop_strings:
            at = text.find(stop, max(num_held - len(stop) + 1, 0))
            if at != -1 and at < best_at:
                best_at, best = at, stop
        return best_at, best

    def _advance_partials(self, text: str) -> int:
        """Moves each stop string's partial match over `text`; returns the longest (what to hold)."""
        for i, (stop, fallback) in enumerate(zip(self.stop_strings, self._fallbacks, strict=True)):
            matched = self._partials[i]
            for char in text:
                while matched and stop[matched] != char:
                    matched = fallback[matched - 1]
                if stop[matched] == char:
                    matched += 1
                    if len(fallback) < matched:  # fallback[matched - 1] may be read next
                        _grow_fallback_table(fallback, stop, matched)
                if matched == len(stop):  # whole (within min_tokens, or unmatched): keep its longest border
                    matched = fallback[matched - 1]
            self._partials[i] = matched
        return max(self._partials)


def _grow_fallback_table(table: list[int], stop: str, size: int) -> None:
    """Extends `table`, the first entries of KMP's failure function of `stop`, to its first `size`: entry i
    is the longest proper prefix of stop[: i + 1] that is also its suffix, where a partial match falls back
    to when the next character does not continue it. Entry i needs only those before it, so growing the
    table a piece at a time costs what building it whole would, up to `size`."""
    if not table:
        table.append(0)
    for i in range(len(table), size):
        matched = table[i - 1]
        while matched and stop[i] != stop[matched]:
            matched = table[matched - 1]
        if stop[i] == stop[matched]:
            matched += 1
        table.append(matched)
