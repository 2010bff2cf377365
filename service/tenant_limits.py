"""Per-tenant admission: at most `max_concurrent_requests` live requests and a token bucket of
`requests_per_second` (size `burst`). A refused request gets RESOURCE_EXHAUSTED with a
`grpc-retry-pushback-ms` trailer saying when a retry may succeed.

    admit(tenant) ──over concurrency──> TenantOverLimitError(retry after CONCURRENCY_PUSHBACK_MS)
                  ──bucket empty──────> TenantOverLimitError(retry after the next token is due)
                  ──else──────────────> a release callable (call it once the request ends)
    refund(tenant): gives the token back, for a request the server refused for its own load (full queue)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from sluice.engine.errors import SluiceError
from sluice.service.tenants import Tenant

# A concurrency slot frees when some request ends: unknown when, so a short fixed hint.
CONCURRENCY_PUSHBACK_MS = 500


class TenantOverLimitError(SluiceError):
    """A tenant is over its concurrency or rate limit (RESOURCE_EXHAUSTED, with a pushback trailer)."""

    def __init__(self, message: str, retry_pushback_ms: int) -> None:
        super().__init__(message)
        self.retry_pushback_ms = retry_pushback_ms


@dataclass
class _Bucket:
    tokens: float
    updated: float


class TenantLimiter:
    """Counts each tenant's live requests and refills its token bucket; one per server."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._live: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}

    def live(self, tenant: Tenant) -> int:
        return self._live.get(tenant.name, 0)

    def admit(self, tenant: Tenant) -> Callable[[], None]:
        """Raises TenantOverLimitError, or takes a slot (and a token) and returns its release."""
        limit = tenant.max_concurrent_requests
        if limit is not None and self.live(tenant) >= limit:
            raise TenantOverLimitError(
                f"tenant {tenant.name!r} has {limit} requests running, its max_concurrent_requests; "
                f"retry in {CONCURRENCY_PUSHBACK_MS} ms",  # in-band on StreamGenerate, which has no trailer
                CONCURRENCY_PUSHBACK_MS,
            )
        self._take_token(tenant)
        self._live[tenant.name] = self.live(tenant) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._live[tenant.name] -= 1

        return release

    def refund(self, tenant: Tenant) -> None:
        """Returns the token `admit` took, for a request the server turned away for its own load (its
        queue was full): the retry the pushback asks for must not find the tenant's bucket empty."""
        bucket = self._buckets.get(tenant.name)
        if bucket is not None and tenant.burst is not None:
            bucket.tokens = min(tenant.burst, bucket.tokens + 1.0)

    def _take_token(self, tenant: Tenant) -> None:
        rate, burst = tenant.requests_per_second, tenant.burst
        if rate is None or burst is None:
            return
        now = self._clock()
        bucket = self._buckets.setdefault(tenant.name, _Bucket(burst, now))
        bucket.tokens = min(burst, bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens < 1.0:
            wait_ms = math.ceil((1.0 - bucket.tokens) / rate * 1000)
            raise TenantOverLimitError(
                f"tenant {tenant.name!r} is over its rate of {rate:g} requests/s; retry in {wait_ms} ms",
                wait_ms,
            )
        bucket.tokens -= 1.0
