"""Call and Caller: the gRPC call a request came through (its metadata, with the traceparent; the method
called; its deadline), and who sent it (the tenant its API key names)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from sluice.service.tenants import Tenant

Metadata = Sequence[tuple[str, str | bytes]]


def no_deadline() -> float | None:
    return None


@dataclass(frozen=True)
class Call:
    """`rpc_service` and `rpc_method` name the gRPC method called ("sluice.v1.InferenceService",
    "Generate"); `seconds_left` reads the call's time to its deadline. Known before the call is
    authenticated, so that the span of a call refused on arrival records it too."""

    metadata: Metadata = ()
    rpc_service: str = ""
    rpc_method: str = ""
    seconds_left: Callable[[], float | None] = no_deadline

    @classmethod
    def of(cls, context: grpc.aio.ServicerContext, rpc_service: str, rpc_method: str) -> Call:
        """The call `context` serves, a call of `rpc_method` of `rpc_service`."""
        return cls(context.invocation_metadata() or (), rpc_service, rpc_method, context.time_remaining)

    def time_remaining(self) -> float | None:
        """Seconds before the call's deadline (0 or less once it passed); None for a call without one."""
        return self.seconds_left()


@dataclass(frozen=True)
class Caller:
    """The tenant that sent a request, and the call the request came through."""

    tenant: Tenant
    call: Call = field(default_factory=Call)
