"""StreamGenerate's session without a server: a client that sends and never reads stops being read once
a refusal waits to be written (each refused request grew the outbox: 42,000 of them held 70 MB); a
request whose call ends before its pump starts is still counted; a message without an action is answered
with an error naming the field, and the stream goes on."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from sluice.service.caller import Caller
from sluice.service.stream_session import StreamSession
from sluice.service.tenants import Tenant
from sluice.v1 import sluice_pb2 as pb

NUM_SENT = 100
CALLER = Caller(Tenant())  # a call without a deadline: its end is a cancel


class _UntracedRunner:
    """A runner no request reaches (every one is refused on arrival), whose refusals record no span."""

    def refusals(self, caller: Caller, request: pb.GenerateRequest) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    async def run(self, *args, **kwargs):
        await asyncio.Event().wait()  # a request that runs until the call ends
        yield


async def test_a_refused_request_is_written_before_the_next_is_read() -> None:
    num_read = 0
    statuses: list[grpc.StatusCode] = []

    async def requests():
        nonlocal num_read
        for _ in range(NUM_SENT):  # every one refused: an empty request_id
            num_read += 1
            yield pb.StreamGenerateRequest(generate=pb.GenerateRequest(text="hi"))

    session = StreamSession(_UntracedRunner(), CALLER, lambda: None, lambda _, code: statuses.append(code))
    responses = session.run(requests())
    first = await anext(responses)  # the call writes one response, and no more
    for _ in range(10):
        await asyncio.sleep(0)
    assert first.error.message == "request_id: must not be empty on StreamGenerate"
    assert num_read <= 2, num_read
    rest = [response async for response in responses]  # the call writes again: the stream goes on
    assert len(rest) == NUM_SENT - 1 and num_read == NUM_SENT
    assert statuses == [grpc.StatusCode.INVALID_ARGUMENT] * NUM_SENT


async def test_a_request_whose_call_ends_before_its_pump_starts_is_counted_cancelled() -> None:
    """The call is cancelled as its request is read: the pump, cancelled before its first step, ran
    none of its body, and the request was counted nowhere (93 of 95 such requests in a race)."""
    statuses: list[grpc.StatusCode] = []
    session = StreamSession(_UntracedRunner(), CALLER, lambda: None, lambda _, code: statuses.append(code))

    async def requests():
        call.cancel()  # the call ends; its handler wakes after the pump made below is scheduled
        yield pb.StreamGenerateRequest(generate=pb.GenerateRequest(request_id="r", text="hi"))
        await asyncio.Event().wait()

    async def serve() -> list[pb.StreamGenerateResponse]:
        return [response async for response in session.run(requests())]

    call = asyncio.create_task(serve())
    with pytest.raises(asyncio.CancelledError):
        await call
    assert statuses == [grpc.StatusCode.CANCELLED]
    assert session.num_live_requests == 0


class _OneChunkRunner(_UntracedRunner):
    """A runner whose every request ends with its first chunk."""

    async def run(self, *args, **kwargs):
        yield pb.GenerateResponse(text="hi", finish_reason=pb.FINISH_REASON_LENGTH)


async def test_a_request_is_live_until_its_last_chunk_is_written() -> None:
    """Its id is free once its last chunk is queued, but it counted as ended then: a drain found the
    server idle while the call still had that chunk to write, and cut it (UNAVAILABLE, the answers
    lost); and a half-close ended the stream at that write, cancelling the pump it woke: counted
    CANCELLED, though the client had every chunk and the call ended OK."""
    statuses: list[grpc.StatusCode] = []
    half_close = asyncio.Event()

    async def requests():  # one request, then half-close
        yield pb.StreamGenerateRequest(generate=pb.GenerateRequest(request_id="r", text="hi"))
        await half_close.wait()

    session = StreamSession(_OneChunkRunner(), CALLER, lambda: None, lambda _, code: statuses.append(code))
    responses = session.run(requests())
    last = await anext(responses)  # taken by the call, not yet written: that is the next `anext`
    assert last.request_id == "r" and last.chunk.finish_reason == pb.FINISH_REASON_LENGTH
    assert session.num_live_requests == 1
    half_close.set()
    for _ in range(10):  # the session reads the half-close before the call writes the chunk
        await asyncio.sleep(0)
    assert [response async for response in responses] == []
    assert statuses == [grpc.StatusCode.OK] and session.num_live_requests == 0


async def test_a_message_without_an_action_is_answered_naming_the_field_and_the_stream_goes_on() -> None:
    statuses: list[grpc.StatusCode] = []

    async def requests():
        yield pb.StreamGenerateRequest()  # neither generate nor cancel
        yield pb.StreamGenerateRequest(generate=pb.GenerateRequest(text="hi"))  # refused: no request_id

    session = StreamSession(_UntracedRunner(), CALLER, lambda: None, lambda _, code: statuses.append(code))
    responses = [response async for response in session.run(requests())]
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert [(r.request_id, r.error.code, r.error.message) for r in responses] == [
        ("", invalid.value[0], "action: set generate or cancel"),
        ("", invalid.value[0], "request_id: must not be empty on StreamGenerate"),
    ]
    assert statuses == [invalid, invalid] and session.num_live_requests == 0
