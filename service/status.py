"""The one place where exceptions become gRPC status codes.

QueueFullError, TenantOverLimitError    -> RESOURCE_EXHAUSTED + `grpc-retry-pushback-ms` trailer
ContextLengthError                      -> RESOURCE_EXHAUSTED (no trailer: a retry cannot help)
UnknownRequestError                     -> NOT_FOUND
RequestIdInUseError                     -> ALREADY_EXISTS
RequestTimeoutError                     -> DEADLINE_EXCEEDED  (the request's own timeout_seconds)
UnauthenticatedError                    -> UNAUTHENTICATED
PermissionDeniedError                   -> PERMISSION_DENIED  (the caller's tenant may not make this call)
InvalidRequestError, ValueError         -> INVALID_ARGUMENT   (message names the field)
ServiceUnavailableError, EngineDeadError -> UNAVAILABLE       (loading, draining, the engine failed:
                                                               a retry goes to another replica)
ReplayExpiredError                      -> OUT_OF_RANGE       (a KV event cursor no longer replayable)
SubscriberLagError                      -> DATA_LOSS          (a KV event subscriber fell behind)
EngineStoppedError                      -> UNAVAILABLE
UnimplementedError                      -> UNIMPLEMENTED      (the server is not set up for the RPC)
RequestFailedError                      -> INTERNAL
asyncio.CancelledError                  -> DEADLINE_EXCEEDED when the deadline passed, else CANCELLED

A message is cut to MAX_MESSAGE_BYTES (`bounded_message`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from sluice.engine.errors import ContextLengthError, EngineDeadError, QueueFullError, UnknownRequestError
from sluice.engine.frontend.kv_event_log import EngineStoppedError, ReplayExpiredError, SubscriberLagError
from sluice.service.request_ids import RequestIdInUseError
from sluice.service.tenant_limits import TenantOverLimitError

logger = logging.getLogger(__name__)

StatusRecorder = Callable[[str, grpc.StatusCode], None]
"""Counts a call's final status: (method name, code)."""

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class ServiceUnavailableError(Exception):
    """The server cannot take requests now: the model is loading or the server is draining."""


class RequestFailedError(Exception):
    """The engine ended a request with finish_reason "error"."""


class RequestTimeoutError(Exception):
    """The request's own timeout_seconds passed; the engine request was aborted."""


class UnauthenticatedError(Exception):
    """The call carries no known API key."""


class PermissionDeniedError(Exception):
    """The caller's tenant may not make this call (e.g. SubscribeKvEvents without `kv_events = true`)."""


class FailedPreconditionError(Exception):
    """The server is not set up for this call (e.g. StartProfile without --profile-dir)."""


class UnimplementedError(Exception):
    """The server does not serve this RPC as started (e.g. SubscribeKvEvents without --kv-events)."""


# A status's message travels in the grpc-message trailer, percent-encoded (a non-ASCII byte takes three).
# A gRPC client refuses trailers over its metadata limit with RESOURCE_EXHAUSTED in place of the status
# sent (by default some calls above 8 KiB, every call above 16 KiB). Messages quote what the caller sent
# (an id, a stop string, a tool name): they are cut to this.
MAX_MESSAGE_BYTES = 1024


def bounded_message(message: str) -> str:
    """`message`, or its first MAX_MESSAGE_BYTES bytes of UTF-8 (whole characters) and how many more."""
    data = message.encode()
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    kept = data[:MAX_MESSAGE_BYTES].decode(errors="ignore")
    return f"{kept}... ({len(data) - len(kept.encode())} more bytes)"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller sees for `exc`."""
    code, message = _status_for(exc)
    return code, bounded_message(message)


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, QueueFullError | ContextLengthError | TenantOverLimitError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, UnknownRequestError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, RequestIdInUseError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, RequestTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, PermissionDeniedError):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, FailedPreconditionError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, UnimplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc)
    if isinstance(exc, ReplayExpiredError):
        return grpc.StatusCode.OUT_OF_RANGE, f"start_sequence_number: {exc}"
    if isinstance(exc, SubscriberLagError):
        return grpc.StatusCode.DATA_LOSS, f"the subscriber fell behind: {exc}"
    if isinstance(exc, EngineStoppedError):
        return grpc.StatusCode.UNAVAILABLE, f"the engine stopped: {exc}"
    if isinstance(exc, ValueError):  # InvalidRequestError is a ValueError
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ServiceUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, f"the engine failed: {exc}"
    if isinstance(exc, RequestFailedError):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


def retry_pushback_ms(exc: BaseException) -> int | None:
    """Milliseconds after which a retry of the refused call may succeed; None: no hint."""
    if isinstance(exc, TenantOverLimitError | QueueFullError):
        return exc.retry_pushback_ms
    return None


def trailers_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata of a call that failed with `exc`: the retry pushback, when there is one."""
    pushback = retry_pushback_ms(exc)
    return () if pushback is None else ((RETRY_PUSHBACK_KEY, str(pushback)),)


# The caller's deadline timer runs from when it sent the call, ours from when it arrived: when the caller's
# fires first, its cancel reaches us with up to that delay left on ours. Within this much of our deadline,
# a cancel is the deadline's.
DEADLINE_SLACK_S = 1.0


class CallDeadline(Protocol):
    """A call's deadline: grpc.aio.ServicerContext, or the Caller of a request."""

    def time_remaining(self) -> float | None: ...


def cancelled_status(call: CallDeadline) -> grpc.StatusCode:
    """Why a handler was cancelled: its deadline passed (here or, just before, at the caller), or the
    caller went away."""
    remaining = call.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def failure_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """`status_for(exc)` for a request that failed; a failure of the server's own (INTERNAL), not the
    caller's, is logged with its traceback."""
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("request failed", exc_info=exc)
    return code, message


def rpc_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a servicer method (unary or streaming): raised exceptions end the call with the
    status `status_for` gives, and every call's final status is reported to `self.record_status`."""
    name = method.__name__

    async def fail(self: Any, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        code, message = failure_status(exc)
        self.record_status(name, code)
        await context.abort(code, message, trailing_metadata=trailers_for(exc))

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async with contextlib.aclosing(method(self, request, context)) as responses:
                    async for response in responses:
                        yield response
            except (asyncio.CancelledError, GeneratorExit):
                self.record_status(name, cancelled_status(context))
                raise
            except Exception as exc:
                await fail(self, context, exc)
            else:
                self.record_status(name, grpc.StatusCode.OK)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            response = await method(self, request, context)
        except asyncio.CancelledError:
            self.record_status(name, cancelled_status(context))
            raise
        except Exception as exc:
            await fail(self, context, exc)
        else:
            self.record_status(name, grpc.StatusCode.OK)
            return response

    return unary_wrapper
