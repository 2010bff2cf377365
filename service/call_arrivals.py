"""CallArrivals: when the server last handed a call to a handler (any service), so that a drain can
wait until calls have stopped coming before grpc's stop() (`wait_for_quiet`; sluice.service.server)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

# A wake-up this much later than due means the event loop was busy or the process starved: calls may be
# waiting in grpc's queue that no handler has seen, so the quiet window seen so far proves nothing.
LATE_WAKE_S = 0.05


class CallArrivals(grpc.aio.ServerInterceptor):
    """A server interceptor that only notes the time (time.monotonic()) of the latest call."""

    def __init__(self) -> None:
        self.last_arrival = float("-inf")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        self.last_arrival = time.monotonic()
        return await continuation(handler_call_details)

    async def wait_for_quiet(
        self,
        quiet_s: float,
        earliest: float,
        latest: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> bool:
        """True once `earliest` has passed and no call has arrived for `quiet_s` of time in which the event
        loop kept its schedule; False at `latest` without such a window. The window restarts at every
        arrival and at every wake-up more than LATE_WAKE_S late (a starved loop hands no queued call to
        the interceptor, so its silence is no quiet). Times are `clock`'s (time.monotonic)."""
        due = max(clock(), earliest)
        await sleep(max(0.0, due - clock()))
        late_at = float("-inf")  # the last late wake-up: quiet counts from after it
        while (now := clock()) < latest:
            if now - due > LATE_WAKE_S:
                late_at = now
            quiet_for = now - max(self.last_arrival, late_at)
            if quiet_for >= quiet_s:
                return True
            due = now + min(quiet_s - quiet_for, latest - now)
            await sleep(due - now)
        return False
