"""Caller: who sent a request (its tenant), the call's metadata (traceparent, ...), the gRPC method it came
through, and the call's deadline."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluice.service.tenants import Tenant

Metadata = Sequence[tuple[str, str | bytes]]


def no_deadline() -> float | None:
    return None


@dataclass(frozen=True)
class Caller:
    """`rpc_service` and `rpc_method` name the gRPC method the request came through ("sluice.v1.
    InferenceService", "Generate"); `seconds_left` reads the call's time to its deadline."""

    tenant: Tenant
    metadata: Metadata = ()
    rpc_service: str = ""
    rpc_method: str = ""
    seconds_left: Callable[[], float | None] = no_deadline

    def time_remaining(self) -> float | None:
        """Seconds before the call's deadline (0 or less once it passed); None for a call without one."""
        return self.seconds_left()
