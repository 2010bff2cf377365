"""`CallArrivals.wait_for_quiet`, the drain's wait before grpc's stop(), on a simulated clock: the quiet
window counts only time in which the event loop kept its schedule. A loop that wakes late (busy, or the
process starved) may hold calls in grpc's queue that no handler has seen yet; taking its silence for quiet
sent the GOAWAY before them, and grpc cancelled them (CANCELLED: no client retries it)."""

from __future__ import annotations

import asyncio

import pytest

from sluice.service.call_arrivals import LATE_WAKE_S, CallArrivals

QUIET_S = 0.25


class SimulatedLoop:
    """A clock and a sleep for `wait_for_quiet`. Each sleep advances the clock by its delay plus the
    lateness given for that wake-up. Calls that arrive before the wake-up is due reach the interceptor as
    they come; calls that arrive while the loop is late wait in grpc's queue and reach it only after the
    waiter's check, when the waiter sleeps again (the order a starved loop runs them in)."""

    def __init__(self, arrivals: CallArrivals, lateness: list[float], calls: list[float]) -> None:
        self.arrivals = arrivals
        self.now = 0.0
        self.lateness = list(lateness)
        self.calls = sorted(calls)
        self.wakes: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        assert delay >= 0
        self._hand_over(self.now, at=self.now)  # queued while the loop was late
        due = self.now + delay
        self.now = due + (self.lateness.pop(0) if self.lateness else 0.0)
        self.wakes.append(self.now)
        self._hand_over(due)

    def _hand_over(self, until: float, at: float | None = None) -> None:
        while self.calls and self.calls[0] <= until:
            arrived = self.calls.pop(0)
            self.arrivals.last_arrival = arrived if at is None else at

    def wait(self, earliest: float, latest: float) -> bool:
        return asyncio.run(
            self.arrivals.wait_for_quiet(QUIET_S, earliest, latest, clock=self.clock, sleep=self.sleep)
        )


def _loop(last_arrival: float, lateness=(), calls=()) -> SimulatedLoop:
    arrivals = CallArrivals()
    arrivals.last_arrival = last_arrival
    return SimulatedLoop(arrivals, list(lateness), list(calls))


def test_on_schedule_the_quiet_before_earliest_counts():
    loop = _loop(last_arrival=0.4)
    assert loop.wait(earliest=0.5, latest=10.0)
    assert loop.now == pytest.approx(0.4 + QUIET_S)
    quiet_already = _loop(last_arrival=-1.0)
    assert quiet_already.wait(earliest=0.5, latest=10.0) and quiet_already.now == pytest.approx(0.5)


def test_a_late_wake_up_restarts_the_window_and_sees_the_calls_the_loop_had_queued():
    # Due at 0.5, the loop wakes at 0.8 with a call queued since 0.6 that no handler has seen: by the
    # arrivals alone it has been quiet 0.4 s (the GOAWAY went out then, and grpc cancelled the call).
    # The window restarts at 0.8; the queued call reaches the interceptor right after; quiet from there.
    loop = _loop(last_arrival=0.4, lateness=[0.3], calls=[0.6])
    assert loop.wait(earliest=0.5, latest=10.0)
    assert loop.wakes[0] == pytest.approx(0.8)
    assert loop.arrivals.last_arrival == pytest.approx(0.8) and loop.calls == []
    assert loop.now == pytest.approx(0.8 + QUIET_S)


def test_lateness_within_the_margin_is_on_schedule():
    loop = _loop(last_arrival=0.4, lateness=[LATE_WAKE_S / 2])
    assert loop.wait(earliest=0.5, latest=10.0)
    assert loop.now == pytest.approx(0.4 + QUIET_S)  # the window from 0.4 held
    assert len(loop.wakes) == 2


def test_calls_that_keep_coming_or_a_loop_always_late_run_to_latest():
    busy = _loop(last_arrival=0.0, calls=[0.1 * i for i in range(1, 40)])
    assert not busy.wait(earliest=0.5, latest=2.0) and busy.now >= 2.0
    starved = _loop(last_arrival=-5.0, lateness=[2 * LATE_WAKE_S] * 100)
    assert not starved.wait(earliest=0.5, latest=2.0) and starved.now >= 2.0
