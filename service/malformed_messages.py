"""Request messages that do not parse: INVALID_ARGUMENT naming the message type and the parser's reason.

grpc.aio parses each request message with its handler's deserializer (the generated `FromString`) before
any Sluice code runs. A DecodeError there (invalid UTF-8 in a string field, a truncated message, garbage
bytes) ended a unary call UNKNOWN "Unexpected <class 'DecodeError'>" with a traceback in the log, and a
StreamGenerate call INTERNAL, logged as a server fault, with its other requests. The interceptor swaps
every handler's deserializer for one that never raises: a message that does not parse becomes a
MalformedMessageError in its place, which the handler's wrapper refuses.

    unary request      the call ends INVALID_ARGUMENT; the handler never runs
    request stream     at that message, the call ends INVALID_ARGUMENT once the client has stopped writing
                       (sluice.service.stream_refusal); a `refused_by_handler` method gets the error in its
                       request stream instead (StreamGenerate answers it in-band and the stream goes on)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from sluice.service.method_handlers import Behaviour, Deserializer, handler_like
from sluice.service.stream_refusal import drain_request_stream

# Takes a call's request (or request stream) before its behaviour does: refuses it, or hands it on.
RequestCheck = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class MalformedMessageError(ValueError):
    """A request message that did not parse, given to the handler in place of the message. A ValueError:
    sluice.service.status maps it to INVALID_ARGUMENT."""

    def __init__(self, type_name: str, reason: str) -> None:
        super().__init__(f"the request message ({type_name}) did not parse: {reason}")


def lenient_deserializer(deserializer: Deserializer) -> Deserializer:
    """`deserializer` (a message class's FromString), giving a MalformedMessageError where it raises
    DecodeError."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    type_name = getattr(descriptor, "full_name", None) or getattr(deserializer, "__qualname__", "request")
    # The parser names the type itself (upb: "Error parsing message with type 'pkg.Type': <reason>").
    prefix = f"Error parsing message with type '{type_name}': "

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return MalformedMessageError(type_name, str(exc).removeprefix(prefix))

    return deserialize


class MalformedMessageInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call whose request message does not parse with INVALID_ARGUMENT, naming the type and the
    parser's reason; except for `refused_by_handler` methods ('/pkg.Service/Method', streaming requests),
    whose handlers get the MalformedMessageError in the request stream and refuse it themselves.
    `on_refused` is called with the method of each call refused here, as it ends. Last among the server's
    interceptors: one before it (the API key's) refuses a call first."""

    def __init__(
        self, refused_by_handler: Sequence[str] = (), on_refused: Callable[[str], None] = lambda method: None
    ) -> None:
        self._by_handler = frozenset(refused_by_handler)
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:  # None: the handler takes bytes
            return handler
        behaviour = _behaviour(handler)
        if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
            return handler  # a sync behaviour (none of Sluice's) is left as grpc runs it
        method = handler_call_details.method
        if method not in self._by_handler:
            check = _checked_stream if handler.request_streaming else _checked_message
            refused = functools.partial(self._on_refused, method)
            behaviour = _with_request_check(behaviour, functools.partial(check, refused=refused))
        return handler_like(handler, behaviour, lenient_deserializer(handler.request_deserializer))


def _behaviour(handler: grpc.RpcMethodHandler) -> Behaviour:
    return handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary


def _with_request_check(behaviour: Behaviour, check: RequestCheck) -> Behaviour:
    """`behaviour`, of the same kind (grpc.aio runs an async generator function's responses, and a
    coroutine function as one that writes its own), taking its request through `check` first."""
    if inspect.isasyncgenfunction(behaviour):

        async def responses(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with contextlib.aclosing(behaviour(await check(request, context), context)) as inner:
                async for response in inner:
                    yield response

        return responses

    async def response(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(await check(request, context), context)

    return response


async def _checked_message(
    request: Any, context: grpc.aio.ServicerContext, *, refused: Callable[[], None]
) -> Any:
    """The request, or the call ended INVALID_ARGUMENT for one that did not parse."""
    if isinstance(request, MalformedMessageError):
        refused()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
    return request


async def _checked_stream(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, *, refused: Callable[[], None]
) -> AsyncIterator[Any]:
    """The request stream, which ends the call INVALID_ARGUMENT at a message that did not parse."""
    return _checked_requests(requests, context, refused)


async def _checked_requests(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, refused: Callable[[], None]
) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, MalformedMessageError):
            await drain_request_stream(requests)  # else a grpc.aio client may see INTERNAL
            refused()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        yield request
