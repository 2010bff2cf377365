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
    nothing)."""

    def __init__(self) -> None:
        # (priority, arrival time, seq, request, its tokens to compute when pushed)
        self._heap: list[tuple[int, float, int, Request, int]] = []
        self.num_tokens = 0

    def push(self, request: Request, seq: int, num_tokens: int) -> None:
        """`num_tokens`: the tokens the request has yet to compute, those of steps in flight included (a
        request preempted under async scheduling gets its token in flight while it waits)."""
        # seq is unique per request, so tuples never fall through to comparing Request objects.
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request, num_tokens))
        self.num_tokens += num_tokens

    def peek(self) -> Request:
        """The request that runs next. Raises IndexError when empty."""
        return self._heap[0][3]

    def pop(self) -> Request:
        entry = heapq.heappop(self._heap)
        self.num_tokens -= entry[4]
        return entry[3]

    def remove(self, request: Request) -> bool:
        """Take `request` out wherever it sits (O(n)); False if it is not queued."""
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self.num_tokens -= entry[4]
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Requests in run order (sorts a copy; for inspection, not the hot path)."""
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))
