"""Caller: who sent a request (its tenant) and the call's metadata (traceparent, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.service.tenants import Tenant

Metadata = Sequence[tuple[str, str | bytes]]


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    metadata: Metadata = ()
