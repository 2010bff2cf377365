"""Injected faults, so tests can check failure handling in real processes. Off unless the variable is set.

    SLUICE_INJECT_FAULT="<where>:<marker>"   e.g. "step:poison", "detokenize:bad-"

where:
    step        the engine step raises while a request whose id contains <marker> is scheduled
                (an engine failure: the core dies)
    sample      sampling raises for requests whose id contains <marker> (those requests fail alone)
    worker      a tensor-parallel worker process (rank >= 1) raises while such a request is scheduled
                (an engine failure: the worker exits, the engine fails)
    join        the tensor-parallel worker of rank <marker> raises before it joins the group (the
                engine fails to start)
    detokenize  the frontend's detokenization raises for such requests (those requests fail alone)
    busy        the first engine step that schedules such a request keeps the CPU busy for SLOW_STEP_S
                seconds (a long step, which the frontend must not take for a hang)
    stall       the first engine step that schedules such a request sleeps SLOW_STEP_S seconds (a hung
                step, silent: the frontend fails the engine after its engine timeout)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

ENV_VAR = "SLUICE_INJECT_FAULT"
PLACES = ("step", "sample", "detokenize", "worker", "join", "busy", "stall")
SLOW_PLACES = ("busy", "stall")  # checked where "step" is
SLOW_STEP_S = 6.0


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class FaultInjector:
    place: str
    marker: str
    _slowed: set[str] = field(default_factory=set, compare=False)  # the requests a slow step held

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        value = os.environ.get(ENV_VAR)
        if not value:
            return None
        place, _, marker = value.partition(":")
        if place not in PLACES or not marker:
            raise ValueError(f"{ENV_VAR}: expected '<{'|'.join(PLACES)}>:<marker>', got {value!r}")
        return cls(place, marker)

    def check(self, place: str, request_ids: Iterable[str]) -> None:
        """Raises InjectedFault when `place` is this injector's and a request id carries the marker; at
        "step", a "busy" or "stall" injector holds the step instead (once a request)."""
        slow = place == "step" and self.place in SLOW_PLACES
        if place != self.place and not slow:
            return
        hit = next((r for r in request_ids if self.marker in r), None)
        if hit is None:
            return
        if not slow:
            raise InjectedFault(f"injected {place} fault for request {hit!r}")
        if hit not in self._slowed:
            self._slowed.add(hit)
            _hold(self.place == "busy", SLOW_STEP_S)


def _hold(busy: bool, seconds: float) -> None:
    """Returns after `seconds`, spent using the CPU (`busy`: Python's loop, which lets other threads run
    between its bytecodes) or asleep."""
    if not busy:
        time.sleep(seconds)
        return
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
