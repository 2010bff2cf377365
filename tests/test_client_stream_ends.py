"""How a Python client's stream ends when its reader does not end it: closed by another thread or task,
its channel closed under it, or the reading asyncio task cancelled. Against the real server; every case
must also abort the request there."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from service_harness import PATIENCE_S, UNENDING, ServerThread, wait_for

from sluice import AsyncClient, Client, SluiceError, generate_request

pytestmark = pytest.mark.timeout(180)


def _read_all_in_a_thread(stream) -> tuple[threading.Thread, threading.Event, list[object]]:
    """Starts a thread reading `stream` to its end; `ended` gets "ended" or the exception it raised."""
    started, ended = threading.Event(), []

    def read() -> None:
        try:
            for _ in stream:
                started.set()
            ended.append("ended")
        except BaseException as error:  # noqa: BLE001 - what the reader saw is the assertion
            ended.append(error)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, started, ended


def test_a_stream_closed_by_another_thread_ends_for_its_reader(server: ServerThread) -> None:
    """Not SluiceError(CANCELLED), the status of the cancel that `close()` itself caused."""
    with Client(server.target) as client:
        stream = client.generate(generate_request("Hello", **UNENDING))
        thread, started, ended = _read_all_in_a_thread(stream)
        assert started.wait(PATIENCE_S)
        stream.close()
        thread.join(PATIENCE_S)
        assert ended == ["ended"]
        server.wait_idle()


def test_a_client_closed_under_a_reading_thread_fails_its_stream_as_cancelled(server: ServerThread) -> None:
    client = Client(server.target)
    stream = client.generate(generate_request("Hello", **UNENDING))
    thread, started, ended = _read_all_in_a_thread(stream)
    assert started.wait(PATIENCE_S)
    client.close()
    thread.join(PATIENCE_S)
    assert [type(error) for error in ended] == [SluiceError]
    assert ended[0].code == grpc.StatusCode.CANCELLED
    server.wait_idle()


async def _read_all_in_a_task(stream) -> asyncio.Task[str]:
    """A task reading `stream` to its end, returned once it read a chunk (it then waits in read())."""
    started = asyncio.Event()

    async def read() -> str:
        async for _ in stream:
            started.set()
        return "ended"

    task = asyncio.create_task(read())
    await asyncio.wait_for(started.wait(), PATIENCE_S)
    return task


def test_an_async_stream_closed_by_another_task_ends_for_its_reader(server: ServerThread) -> None:
    """grpc.aio raised asyncio.CancelledError in the reading task, which nobody had cancelled."""

    async def run() -> str:
        async with AsyncClient(server.target) as client:
            stream = client.generate(generate_request("Hello", **UNENDING))
            task = await _read_all_in_a_task(stream)
            await stream.aclose()
            return await task

    assert asyncio.run(run()) == "ended"
    server.wait_idle()


def test_an_async_client_closed_under_a_reading_task_fails_its_stream_as_cancelled(
    server: ServerThread,
) -> None:
    """Not asyncio.CancelledError, which would read as the reading task's own cancellation."""

    async def run() -> BaseException:
        client = AsyncClient(server.target)
        task = await _read_all_in_a_task(client.generate(generate_request("Hello", **UNENDING)))
        await client.close()
        (error,) = await asyncio.gather(task, return_exceptions=True)
        return error

    error = asyncio.run(run())
    assert isinstance(error, SluiceError), repr(error)
    assert error.code == grpc.StatusCode.CANCELLED
    server.wait_idle()


def test_cancelling_the_task_of_an_async_call_cancels_the_call(server: ServerThread) -> None:
    """`complete()` and a stream read in a cancelled task raise CancelledError, and the server aborts."""

    async def run(read) -> bool:
        async with AsyncClient(server.target) as client:
            task = asyncio.create_task(read(client))
            await asyncio.to_thread(wait_for, lambda: server.stats().num_running == 1, "the request running")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return task.cancelled()

    async def complete(client: AsyncClient) -> None:
        await client.complete(generate_request("Hello", **UNENDING))

    async def stream(client: AsyncClient) -> None:
        async for _ in client.generate(generate_request("Hello", **UNENDING)):
            pass

    for read in (complete, stream):
        assert asyncio.run(run(read)), read.__name__
        server.wait_idle()
