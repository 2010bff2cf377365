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
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

ENV_VAR = "SLUICE_INJECT_FAULT"
PLACES = ("step", "sample", "detokenize", "worker", "join")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class FaultInjector:
    place: str
    marker: str

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
        """Raises InjectedFault when `place` is this injector's and a request id carries the marker."""
        if place != self.place:
            return
        hit = next((r for r in request_ids if self.marker in r), None)
        if hit is not None:
            raise InjectedFault(f"injected {place} fault for request {hit!r}")
