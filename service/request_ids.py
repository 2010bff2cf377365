"""Generate request ids, per tenant: which are live, which ended lately, and Aborts that came early.

    claim(tenant, id)  over MAX_REQUEST_ID_BYTES ─> InvalidRequestError (INVALID_ARGUMENT), as abort
                       live already ─────────────> RequestIdInUseError (ALREADY_EXISTS)
                       an early Abort remembered ─> a RequestCancel already cancelled (never runs)
                       else ──────────────────────> a fresh RequestCancel, live until release()
    abort(tenant, id)  live ──────> its RequestCancel (the caller cancels it)
                       ended lately (or aborted) ──> None: nothing to do, and OK (idempotent)
                       never seen ─> remembered for `remember_s`, then UnknownRequestError (NOT_FOUND)

Ids are keys per tenant: two tenants may use the same id, and one tenant's Abort never finds another's
request (it is "never seen" from there). Ended ids and early Aborts are kept for `remember_s` seconds
and at most `max_remembered` of each per tenant (oldest dropped first: one tenant's flood of Aborts
drops only its own), and an id is at most MAX_REQUEST_ID_BYTES long (`check_request_id`), so memory
stays bounded whatever callers do (tenants are the configured ones).
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable

from sluice.engine.errors import InvalidRequestError, SluiceError, UnknownRequestError
from sluice.service.request_cancel import ABORT, RequestCancel

REMEMBER_S = 30.0
MAX_REMEMBERED = 10_000
# Room for any id scheme (a UUID is 36 characters, a tenant or trace prefix more). Ids are remembered,
# logged and quoted in statuses: a 100 kB one made an Abort's NOT_FOUND too large for the client's metadata
# limit, which turned it into RESOURCE_EXHAUSTED.
MAX_REQUEST_ID_BYTES = 512

_Key = tuple[str, str]  # (tenant name, request id)


def check_request_id(request_id: str, field: str = "request_id") -> None:
    """InvalidRequestError naming `field` when `request_id` is over MAX_REQUEST_ID_BYTES in UTF-8."""
    size = len(request_id.encode())
    if size > MAX_REQUEST_ID_BYTES:
        raise InvalidRequestError(field, f"must be at most {MAX_REQUEST_ID_BYTES} bytes (UTF-8), got {size}")


def engine_id_of(namespace: str, request_id: str) -> str:
    """The engine's id of a caller's request: `namespace` (the API and tenant, or the stream) and the id
    with "%" and "#" escaped, so that no caller's id is the engine's id of another request's sample ("a#1"
    is sample 1 of "a" with n > 1: a caller's own "a#1" was refused as in use while "a" ran)."""
    return namespace + request_id.replace("%", "%25").replace("#", "%23")


class RequestIdInUseError(SluiceError):
    """A live request of the same tenant already has this id (maps to ALREADY_EXISTS)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request_id: {request_id!r} is already in use by a live request")


class _ExpiringSet:
    """Ids with the time they were added; older than `ttl` or beyond `capacity` are forgotten."""

    def __init__(self, ttl: float, capacity: int, clock: Callable[[], float]) -> None:
        self._ttl, self._capacity, self._clock = ttl, capacity, clock
        self._items: OrderedDict[str, float] = OrderedDict()

    def add(self, key: str) -> None:
        self._items.pop(key, None)
        self._items[key] = self._clock()
        self._expire()

    def pop(self, key: str) -> bool:
        self._expire()
        return self._items.pop(key, None) is not None

    def __contains__(self, key: str) -> bool:
        self._expire()
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        oldest_kept = self._clock() - self._ttl
        while self._items and (
            len(self._items) > self._capacity or next(iter(self._items.values())) < oldest_kept
        ):
            self._items.popitem(last=False)


class RequestIds:
    """The Generate request ids of one server."""

    def __init__(
        self,
        *,
        remember_s: float = REMEMBER_S,
        max_remembered: int = MAX_REMEMBERED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._live: dict[_Key, RequestCancel] = {}

        def remembered() -> _ExpiringSet:
            return _ExpiringSet(remember_s, max_remembered, clock)

        # Per tenant: tenant -> its ids.
        self._ended: defaultdict[str, _ExpiringSet] = defaultdict(remembered)
        self._early_aborts: defaultdict[str, _ExpiringSet] = defaultdict(remembered)

    def claim(self, tenant: str, request_id: str) -> RequestCancel:
        check_request_id(request_id)
        key = (tenant, request_id)
        if key in self._live:
            raise RequestIdInUseError(request_id)
        cancel = RequestCancel()
        if self._early_aborts[tenant].pop(request_id):
            cancel.reason = ABORT
        self._live[key] = cancel
        self._ended[tenant].pop(request_id)
        return cancel

    def release(self, tenant: str, request_id: str, cancel: RequestCancel) -> None:
        key = (tenant, request_id)
        if self._live.get(key) is cancel:
            del self._live[key]
            self._ended[tenant].add(request_id)

    def abort(self, tenant: str, request_id: str) -> RequestCancel | None:
        """The live request's RequestCancel; None if it ended lately; raises UnknownRequestError."""
        check_request_id(request_id)
        key = (tenant, request_id)
        if key in self._live:
            return self._live[key]
        if request_id in self._ended[tenant]:
            return None
        self._early_aborts[tenant].add(request_id)
        raise UnknownRequestError(request_id)

    @property
    def num_live(self) -> int:
        return len(self._live)
