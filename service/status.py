"""The one place where exceptions become gRPC status codes.

QueueFullError, ContextLengthError      -> RESOURCE_EXHAUSTED
InvalidRequestError, ValueError         -> INVALID_ARGUMENT   (message names the field)
ServiceUnavailableError, EngineDeadError -> UNAVAILABLE       (loading, draining, the engine failed:
                                                               a retry goes to another replica)
RequestFailedError                      -> INTERNAL
asyncio.CancelledError                  -> DEADLINE_EXCEEDED when the deadline passed, else CANCELLED
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc

from engine.errors import ContextLengthError, EngineDeadError, QueueFullError

logger = logging.getLogger(__name__)

StatusRecorder = Callable[[str, grpc.StatusCode], None]
"""Counts a call's final status: (method name, code)."""


class ServiceUnavailableError(Exception):
    """The server cannot take requests now: the model is loading or the server is draining."""


class RequestFailedError(Exception):
    """The engine ended a request with finish_reason "error"."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller sees for `exc`."""
    if isinstance(exc, QueueFullError | ContextLengthError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, ValueError):  # InvalidRequestError is a ValueError
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ServiceUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, f"the engine failed: {exc}"
    if isinstance(exc, RequestFailedError):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


def cancelled_status(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """Why a handler was cancelled: its deadline passed, or the caller went away."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
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
        await context.abort(code, message)

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
