"""The waiting queue: requests ordered by (priority, arrival time, insertion sequence).

Lower priority values run first; equals run first-come first-served. A preempted request is pushed back
with its original key, so it keeps its place ahead of newer requests of equal priority.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from sluice.engine.request import Request


class RequestQueue:
    """A min-heap of waiting requests. `seq` breaks ties between equal arrival times. `num_tokens`: the
    tokens the queued requests have yet to compute, kept as they come and go (a waiting request computes
    nothing).

    `remove` is O(1) amortized: the entry stays in the heap, no longer live, and is dropped when it reaches
    the top, when dead entries outnumber the live ones, or when the queue empties (so an idle engine holds
    no removed request). A scan and a heapify per removal made a mass cancel of N
    waiting requests O(N^2): 30,000 took 37 s in one core step, past --engine-timeout."""

    def __init__(self) -> None:
        # (priority, arrival time, seq, request, its tokens to compute when pushed)
        self._heap: list[tuple[int, float, int, Request, int]] = []
        # id(request) -> its live entry; a heap entry that is not here was removed (or pushed again since).
        self._live: dict[int, tuple[int, float, int, Request, int]] = {}
        self.num_tokens = 0

    def push(self, request: Request, seq: int, num_tokens: int) -> None:
        """`num_tokens`: the tokens the request has yet to compute, those of steps in flight included (a
        request preempted under async scheduling gets its token in flight while it waits)."""
        # seq is unique per request, so tuples never fall through to comparing Request objects.
        entry = (request.priority, request.arrival_time, seq, request, num_tokens)
        heapq.heappush(self._heap, entry)
        self._live[id(request)] = entry
        self.num_tokens += num_tokens

    def peek(self) -> Request:
        """The request that runs next. Raises IndexError when empty."""
        self._drop_dead_top()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_dead_top()
        entry = heapq.heappop(self._heap)
        del self._live[id(entry[3])]
        self.num_tokens -= entry[4]
        if not self._live:
            self._heap.clear()
        return entry[3]

    def remove(self, request: Request) -> bool:
        """Take `request` out wherever it sits; False if it is not queued."""
        entry = self._live.pop(id(request), None)
        if entry is None:
            return False
        self.num_tokens -= entry[4]
        if not self._live:
            self._heap.clear()  # nothing keeps a removed request alive once the queue is empty
        elif len(self._heap) > 2 * len(self._live) + 64:  # dead entries are most of the heap: compact it
            self._heap = [e for e in self._heap if self._is_live(e)]
            heapq.heapify(self._heap)
        else:
            self._drop_dead_top()
        return True

    def _is_live(self, entry: tuple[int, float, int, Request, int]) -> bool:
        return self._live.get(id(entry[3])) is entry

    def _drop_dead_top(self) -> None:
        while self._heap and not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self) -> Iterator[Request]:
        """Requests in run order (sorts a copy; for inspection, not the hot path)."""
        return (entry[3] for entry in sorted(self._live.values(), key=lambda e: e[:3]))
