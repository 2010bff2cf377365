"""The stream a streaming call returns: `ResponseStream` (blocking) and `AsyncResponseStream` (asyncio)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from sluice.request_feed import RequestFeed
from sluice.sluice_error import SluiceError


class ResponseStream(Iterator[Any]):
    """The responses of a streaming call, which started when it was made. `close()` (or leaving a `with`
    block) cancels the call, and the server aborts its requests; so does dropping the stream (grpc cancels
    a call it garbage-collects). A closed stream ends, also for a thread reading it while another closes
    it. A failed call raises SluiceError; one its requests' iterator (`feed`) ended by raising, that
    exception."""

    def __init__(self, call: grpc.Call, feed: RequestFeed | None = None) -> None:
        self._call = call
        self._feed = feed
        self._closed = False

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            return next(self._call)
        except grpc.RpcError as error:
            if self._closed:  # closed by another thread while this one waited: the cancel it caused
                raise StopIteration from None
            if self._feed is not None and self._feed.error is not None:
                raise self._feed.error from None
            raise SluiceError.from_rpc_error(error) from None

    def close(self) -> None:
        self._closed = True
        self._call.cancel()

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncResponseStream(AsyncIterator[Any]):
    """`ResponseStream` for asyncio: `await stream.aclose()`, `async with` or dropping the stream (a
    `break` out of `async for`) cancels the call.

    asyncio.CancelledError comes out of a read only when the reading task is cancelled (the call is then
    cancelled too). A call cancelled under a waiting reader by someone else, where grpc.aio raises
    CancelledError in a task nobody cancelled, ends the stream if it was this stream's `aclose()` and
    raises SluiceError(CANCELLED) otherwise (the channel closed). A call its requests' iterator (`feed`)
    ended by raising raises that exception."""

    def __init__(self, call: grpc.aio.Call, feed: RequestFeed | None = None) -> None:
        self._call = call
        self._feed = feed
        self._closed = False

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        try:
            response = await self._call.read()
        except grpc.RpcError as error:
            self._raise_feed_error()
            raise SluiceError.from_rpc_error(error) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            if self._closed:
                raise StopAsyncIteration from None
            self._raise_feed_error()
            raise SluiceError(grpc.StatusCode.CANCELLED, await self._call.details()) from None
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return response

    def _raise_feed_error(self) -> None:
        if self._feed is not None and self._feed.error is not None:
            raise self._feed.error from None

    async def aclose(self) -> None:
        self._closed = True
        self._call.cancel()

    def __del__(self) -> None:
        """Dropped (a `break` out of `async for`, or never read) with its call still running: cancelled,
        as the blocking stream's call is. grpc.aio itself holds a running call until it ends (its channel
        keeps a done-callback on it), so the server went on generating until max_tokens."""
        call = getattr(self, "_call", None)
        if call is not None and not call.done():
            call.cancel()

    async def __aenter__(self) -> AsyncResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
