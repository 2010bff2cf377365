"""CallArrivals: when the server last handed a call to a handler (any service), so that a drain can
wait until calls have stopped coming before grpc's stop() (see sluice.service.server.QUIET_S)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import grpc


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
