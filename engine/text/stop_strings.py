"""Finds stop strings in streamed text, holding back only what could still become one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text pieces with `push`; it returns what is safe to emit.

    Invariant: the held-back text is the longest suffix of the unemitted text that is a proper prefix of some
    stop string, so at most (longest stop string - 1) characters are held, and a stop string that spans
    several pieces is still found. Once `matched` is set, the text from the stop string on is dropped.

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
        keep = self._partial_suffix_len(pending)
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

    def _partial_suffix_len(self, text: str) -> int:
        # Only a suffix starting with a stop string's first character can be a prefix of it, so each stop
        # string costs one `find` over the last (its length - 1) characters when that character is absent.
        longest = 0
        for stop in self.stop_strings:
            at = text.find(stop[0], max(len(text) - len(stop) + 1, 0))
            while at != -1 and len(text) - at > longest:
                if stop.startswith(text[at:]):
                    longest = len(text) - at
                    break
                at = text.find(stop[0], at + 1)
        return longest
