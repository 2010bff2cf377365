"""Requests whose grammar is still compiling. They are not in the scheduler yet, so the requests that
are keep running; each joins the scheduler at the first step after its grammar is ready."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

from sluice.engine.request import Request


class GrammarWaitingRoom:
    """Not thread-safe: the engine thread owns it (the futures complete in the compile thread)."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[Request, Future]] = {}  # arrival order

    def add(self, request: Request, grammar: Future) -> None:
        self._waiting[request.request_id] = (request, grammar)

    def pop_done(self) -> list[tuple[Request, Future]]:
        """The requests whose compilation finished (or failed), in arrival order."""
        done = [rid for rid, (_, future) in self._waiting.items() if future.done()]
        return [self._waiting.pop(rid) for rid in done]

    def remove(self, request_id: str) -> Request | None:
        entry = self._waiting.pop(request_id, None)
        return None if entry is None else entry[0]

    def wait(self, timeout: float) -> None:
        """Block until some grammar is ready or `timeout` seconds pass (returns at once when empty)."""
        if self._waiting:
            wait([future for _, future in self._waiting.values()], timeout, return_when=FIRST_COMPLETED)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def request_ids(self) -> list[str]:
        return list(self._waiting)
