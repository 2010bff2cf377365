"""API-key authentication: every call must carry `authorization: Bearer <key>` metadata; the key
names the caller's tenant (sluice.service.tenants).

Health checks are exempt, so load balancers and probes need no key. The generation methods check the key
in their handlers instead (`authenticated_by_handler`), so that a refused call has its span too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2

from sluice.service.method_handlers import handler_like
from sluice.service.stream_refusal import drain_request_stream
from sluice.service.tenants import Tenant, TenantDirectory

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_BEARER = "bearer "


def _service_of(method: str) -> str:
    """'/pkg.Service/Method' -> 'pkg.Service'."""
    return method.lstrip("/").split("/", 1)[0]


def authenticate(
    metadata: Sequence[tuple[str, str | bytes]] | None, tenants: TenantDirectory
) -> Tenant | str:
    """The caller's tenant, or the reason the call is refused (naming the header). Keys are never echoed."""
    if not tenants.requires_key:
        return tenants.tenants[0]
    values = [v for k, v in metadata or () if k == "authorization" and isinstance(v, str)]
    if not values:
        return "authorization: missing; send 'authorization: Bearer <api key>' metadata"
    value = values[0]
    if not value.lower().startswith(_BEARER):
        return "authorization: must be 'Bearer <api key>'"
    tenant = tenants.tenant_for_key(value[len(_BEARER) :].strip())
    return "authorization: invalid API key" if tenant is None else tenant


def check_api_key(metadata: Sequence[tuple[str, str | bytes]] | None, api_key: str) -> str | None:
    """None if the metadata carries `api_key`; otherwise the reason it does not, naming the header."""
    found = authenticate(metadata, TenantDirectory.single_key(api_key))
    return found if isinstance(found, str) else None


def _denying_handler(
    handler: grpc.RpcMethodHandler, reason: str, refused: Callable[[], None]
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED (calling `refused`)."""

    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        refused()
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def deny_stream(requests: AsyncIterator[object], context: grpc.aio.ServicerContext) -> None:
        await drain_request_stream(requests)  # else a grpc.aio client may see INTERNAL
        refused()
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    behaviour = deny_stream if handler.request_streaming else deny
    return handler_like(handler, behaviour, handler.request_deserializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a known bearer key with UNAUTHENTICATED, before any handler runs; except
    calls of `exempt_services` (no key needed) and of `authenticated_by_handler` ('/pkg.Service/Method':
    the handler refuses the same calls, with the same status and message, itself). `on_refused` is
    called with the method ('/pkg.Service/Method') of each call refused here, as the call ends."""

    def __init__(
        self,
        tenants: TenantDirectory,
        exempt_services: Sequence[str] = (HEALTH_SERVICE,),
        authenticated_by_handler: Sequence[str] = (),
        on_refused: Callable[[str], None] = lambda method: None,
    ) -> None:
        if not tenants.requires_key:
            raise ValueError("tenants: no API keys to check")
        self._tenants = tenants
        self._exempt = frozenset(exempt_services)
        self._by_handler = frozenset(authenticated_by_handler)
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or _service_of(method) in self._exempt or method in self._by_handler:
            return handler
        found = authenticate(handler_call_details.invocation_metadata, self._tenants)
        if isinstance(found, Tenant):
            return handler
        return _denying_handler(handler, found, lambda: self._on_refused(method))
