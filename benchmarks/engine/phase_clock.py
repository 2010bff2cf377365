"""Timing a step's phases by wrapping the engine's methods from outside (`host_overhead`): `PhaseClock`
sums wall and thread-CPU time per phase, `ForwardReplay` hands later calls a callable's first result."""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class PhaseClock:
    """Sums wall and thread-CPU nanoseconds per phase for the step in progress. A phase timed inside
    another counts in both, unless `nested` says the outer one excludes it."""

    def __init__(self) -> None:
        self.wall: dict[str, int] = defaultdict(int)
        self.cpu: dict[str, int] = defaultdict(int)
        self._active: list[str] = []  # the phases running, outermost first
        self._excluded_from: dict[str, set[str]] = defaultdict(set)  # inner phase -> outer phases

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()

    def nested(self, outer: str, inner: str) -> None:
        """Time in `inner` while `outer` runs is not `outer`'s."""
        self._excluded_from[inner].add(outer)

    def timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            self._active.append(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self._active.pop()
                wall, cpu = time.perf_counter_ns() - wall, time.thread_time_ns() - cpu
                self.wall[phase] += wall
                self.cpu[phase] += cpu
                for outer in self._excluded_from.get(phase, ()):
                    if outer in self._active:
                        self.wall[outer] -= wall
                        self.cpu[outer] -= cpu

        return wrapper

    def wrap(self, owner: object, name: str, phase: str) -> None:
        setattr(owner, name, self.timed(phase, getattr(owner, name)))


class ForwardReplay:
    """Replaces a callable by the result of its first call once armed (`--forward replay`)."""

    def __init__(self) -> None:
        self.armed = False
        self.results: dict[str, Any] = {}

    def arm(self) -> None:
        self.armed = True
        self.results.clear()

    def disarm(self) -> None:
        self.armed = False
        self.results.clear()

    def wrap(self, owner: object, name: str) -> None:
        """`owner.name` replayed once armed (an instance attribute, as `PhaseClock.wrap` sets)."""
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.armed:
                return fn(*args, **kwargs)
            if name not in self.results:
                self.results[name] = fn(*args, **kwargs)
            return self.results[name]

        setattr(owner, name, wrapper)
