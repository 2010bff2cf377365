"""Tenants: who a caller is, from its API key, and what it may do.

`--api-keys FILE` is TOML, one `[[tenant]]` table per tenant:

    [[tenant]]
    name = "acme"                   # [A-Za-z0-9._-], 1..64 characters; a metrics label
    keys = ["sk-acme-1", "sk-acme-2"]
    max_priority = 0                # the most urgent priority it may use (lower runs first); a
                                    # request asking for less (e.g. -5) runs at this value (clamped)
    max_concurrent_requests = 32    # optional: live generation requests at once
    requests_per_second = 10.0      # optional: token bucket refill rate ...
    burst = 20                      # ... and size (default: max(1, requests_per_second))
    prefix_cache_scope = "acme"     # optional: tenants with the same scope share prefix-cache blocks;
                                    # default: the tenant's own name (no sharing); as a name
    kv_events = false               # optional: may subscribe to VllmEngine.SubscribeKvEvents (the
                                    # cached token ids of every tenant of its prefix_cache_scope: give
                                    # it to the gateway's key only)

Keys are compared as SHA-256 digests with `hmac.compare_digest` against every key, so the time taken
says nothing about which key (or how much of one) matched; keys never appear in a repr, a log line or
an error message. `--api-key KEY` is one tenant named "default" with no limits (KV events included); with
no key at all every caller is that tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEY = re.compile(r"[!-~]([ -~]*[!-~])?")
KEY_FORM = "printable ASCII without surrounding whitespace"
_FIELDS = frozenset(
    {
        "name",
        "keys",
        "max_priority",
        "max_concurrent_requests",
        "requests_per_second",
        "burst",
        "prefix_cache_scope",
        "kv_events",
    }
)


@dataclass(frozen=True)
class Tenant:
    """One tenant's identity and limits (never its keys)."""

    name: str = DEFAULT_TENANT
    max_priority: int | None = None  # None: any priority
    max_concurrent_requests: int | None = None
    requests_per_second: float | None = None
    burst: float | None = None
    prefix_cache_scope: str | None = None
    # May read the KV event stream, which carries the cached token ids of every tenant of its scope. A
    # tenants file's tables default to False (`_tenant_from_table`); the one tenant of `--api-key` or of
    # no key may.
    kv_events: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"name: {self.name!r} must match [A-Za-z0-9._-]{{1,64}}")
        for name in ("max_priority", "max_concurrent_requests"):
            if getattr(self, name) is not None and type(getattr(self, name)) is not int:
                raise ValueError(f"{name}: must be an integer (tenant {self.name!r})")
        if type(self.kv_events) is not bool:
            raise ValueError(f"kv_events: must be true or false (tenant {self.name!r})")
        for name in ("requests_per_second", "burst"):
            if getattr(self, name) is not None and type(getattr(self, name)) not in (int, float):
                raise ValueError(f"{name}: must be a number (tenant {self.name!r})")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests: must be >= 1 (tenant {self.name!r})")
        rate = self.requests_per_second
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"requests_per_second: must be a finite number > 0 (tenant {self.name!r})")
        if self.burst is not None and not (
            rate is not None and math.isfinite(self.burst) and self.burst >= 1
        ):
            raise ValueError(f"burst: must be >= 1 and needs requests_per_second (tenant {self.name!r})")
        if rate is not None and self.burst is None:
            object.__setattr__(self, "burst", max(1.0, rate))
        scope = self.prefix_cache_scope
        if scope is not None and not (isinstance(scope, str) and _NAME.fullmatch(scope)):
            # A number would share blocks with its text ("5"), and the salt's separator inside a scope
            # would let another tenant's salt spell the same one.
            raise ValueError(
                f"prefix_cache_scope: {scope!r} must match [A-Za-z0-9._-]{{1,64}} (tenant {self.name!r})"
            )

    @property
    def cache_scope(self) -> str:
        """Mixed into every request's cache salt: only tenants with the same scope share blocks."""
        return self.prefix_cache_scope or self.name

    def clamp_priority(self, priority: int) -> int:
        """Lower values run first; a tenant never gets ahead of its max_priority."""
        return priority if self.max_priority is None else max(priority, self.max_priority)

    def cache_salt(self, request_salt: str) -> str:
        """The salt the engine sees: the tenant's scope, then the request's own salt."""
        return f"{self.cache_scope}{_SALT_SEPARATOR}{request_salt}"


_SALT_SEPARATOR = "\x1f"


def request_salt_of(engine_salt: str | None) -> str | None:
    """The request's own salt in a salt the engine saw (`Tenant.cache_salt`); None when it had none."""
    if engine_salt is None:
        return None
    return engine_salt.partition(_SALT_SEPARATOR)[2] or None


def scope_of(engine_salt: str | None) -> str | None:
    """The tenant scope in a salt the engine saw (`Tenant.cache_salt`); None in one no tenant made."""
    if engine_salt is None or _SALT_SEPARATOR not in engine_salt:
        return None
    return engine_salt.partition(_SALT_SEPARATOR)[0]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _check_scopes(tenants: Sequence[Tenant]) -> None:
    """A scope is shared only by the tenants that set it: one named like another tenant, whose scope
    is by default its name, would share that tenant's blocks (and their timing) without its say."""
    names = {tenant.name: tenant for tenant in tenants}
    for tenant in tenants:
        scope = tenant.prefix_cache_scope
        other = names.get(scope or "")
        if other is not None and other is not tenant and other.prefix_cache_scope != scope:
            raise ValueError(
                f"prefix_cache_scope: {scope!r} (tenant {tenant.name!r}) is the scope of "
                f"tenant {other.name!r} by its name; set it there too to share blocks, or choose another"
            )


def check_key(key: str, field: str) -> None:
    """ValueError naming `field`, never the key, unless `key` is a header value a caller can send and
    match: printable ASCII, without surrounding whitespace (the server strips what callers send, so a
    key read with a trailing newline never matched)."""
    if not key:
        raise ValueError(f"{field}: must not be empty")
    if not _KEY.fullmatch(key):
        raise ValueError(f"{field}: must be {KEY_FORM}")


@dataclass(frozen=True)
class TenantDirectory:
    """API key -> tenant. `requires_key` False: nobody needs a key, everyone is the default tenant."""

    _keys: tuple[tuple[bytes, Tenant], ...] = field(default=(), repr=False)
    tenants: tuple[Tenant, ...] = (Tenant(),)

    @property
    def requires_key(self) -> bool:
        return bool(self._keys)

    @classmethod
    def open(cls) -> TenantDirectory:
        """No API key: every caller is the default tenant."""
        return cls()

    @classmethod
    def single_key(cls, api_key: str) -> TenantDirectory:
        """The `--api-key` form: one key, the default tenant, no limits."""
        check_key(api_key, "api_key")
        tenant = Tenant()
        return cls(((_digest(api_key), tenant),), (tenant,))

    @classmethod
    def from_tenants(cls, entries: Iterable[tuple[Tenant, Sequence[str]]]) -> TenantDirectory:
        """Tenants with their keys; names and keys must be unique."""
        keys: list[tuple[bytes, Tenant]] = []
        tenants: list[Tenant] = []
        for tenant, tenant_keys in entries:
            if any(t.name == tenant.name for t in tenants):
                raise ValueError(f"name: tenant {tenant.name!r} is listed twice")
            if not tenant_keys or not all(isinstance(k, str) and k for k in tenant_keys):
                raise ValueError(f"keys: tenant {tenant.name!r} needs one or more non-empty keys")
            for key in tenant_keys:
                if not _KEY.fullmatch(key):
                    raise ValueError(f"keys: a key of tenant {tenant.name!r} is not {KEY_FORM}")
                digest = _digest(key)
                if any(hmac.compare_digest(digest, known) for known, _ in keys):
                    raise ValueError(f"keys: a key of tenant {tenant.name!r} is also given elsewhere")
                keys.append((digest, tenant))
            tenants.append(tenant)
        if not tenants:
            raise ValueError("tenant: the file lists no tenants")
        _check_scopes(tenants)
        return cls(tuple(keys), tuple(tenants))

    @classmethod
    def load(cls, path: str | Path) -> TenantDirectory:
        """Reads an `--api-keys` TOML file (format in this module's docstring)."""
        try:
            document = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            # The decode error's message quotes no values, only positions.
            raise ValueError(f"api-keys: cannot read {str(path)!r}: {exc}") from None
        tables = document.get("tenant")
        if not isinstance(tables, list) or set(document) != {"tenant"}:
            raise ValueError("api-keys: expected only [[tenant]] tables")
        return cls.from_tenants(_tenant_from_table(table) for table in tables)

    def tenant_for_key(self, key: str) -> Tenant | None:
        """The tenant owning `key`, comparing against every key whatever matches; None if none does."""
        presented = _digest(key)
        found = None
        for digest, tenant in self._keys:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found


def _tenant_from_table(table: object) -> tuple[Tenant, Sequence[str]]:
    if not isinstance(table, dict):
        raise ValueError("tenant: each [[tenant]] must be a table")
    unknown = sorted(set(table) - _FIELDS)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown tenant field (known: {', '.join(sorted(_FIELDS))})")
    if "name" not in table:
        raise ValueError("name: every tenant needs a name")
    keys = table.get("keys")
    if not isinstance(keys, list):
        raise ValueError(f"keys: tenant {table['name']!r} needs a list of keys")
    settings = {"kv_events": False} | {k: v for k, v in table.items() if k != "keys"}
    try:
        return Tenant(**settings), keys
    except TypeError as exc:
        raise ValueError(f"tenant: {table['name']!r}: {exc}") from None
