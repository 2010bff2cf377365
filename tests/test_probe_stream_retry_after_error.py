"""A StreamGenerate request ended by its in-band RequestError frees its id once the client can read the
error, as one ended by its last chunk does: a client that fixes a refused request and sends it again under
the same id at once is served. The pump kept the id until the error's write had completed on the server,
so the retry, read meanwhile, was refused ALREADY_EXISTS "already in use by a live request" (245 of 300
such retries on a loopback server), though RequestError "ends one request of a StreamGenerate stream"."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from service_harness import PATIENCE_S, ServerThread, status_code

from sluice import generate_request
from sluice.service.caller import Caller
from sluice.service.stream_session import StreamSession
from sluice.service.tenants import Tenant
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

NUM_RETRIES = 20
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _generate(request_id: str, temperature: float) -> pb.StreamGenerateRequest:
    return pb.StreamGenerateRequest(
        generate=generate_request("hi", request_id=request_id, temperature=temperature, max_tokens=1)
    )


class _RefusesNegativeTemperatures:
    """A runner that refuses a request of a negative temperature, as conversion does, and ends any other
    with one finished chunk."""

    def refusals(self, caller: Caller, request: pb.GenerateRequest) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    async def run(self, request: pb.GenerateRequest, *args, **kwargs):
        if request.sampling_params.temperature < 0:
            raise ValueError("temperature: must be >= 0")
        yield pb.GenerateResponse(request_id=request.request_id, finish_reason=pb.FINISH_REASON_LENGTH)


async def test_the_id_of_a_request_ended_by_an_error_is_free_while_the_error_is_written() -> None:
    retry_read = asyncio.Event()
    error_read = asyncio.Event()

    async def requests():
        yield _generate("x", -1.0)
        await error_read.wait()
        retry_read.set()  # the session starts the retry as this yield returns, before it awaits again
        yield _generate("x", 0.0)

    session = StreamSession(_RefusesNegativeTemperatures(), Caller(Tenant()), lambda: None, lambda *_: None)
    responses = session.run(requests())
    error = await anext(responses)  # the call holds it: its write has not completed yet
    error_read.set()
    await asyncio.wait_for(retry_read.wait(), PATIENCE_S)
    rest = [response async for response in responses]
    assert (error.request_id, error.error.code) == ("x", INVALID.value[0])
    assert [(r.request_id, r.WhichOneof("event"), r.chunk.finish_reason) for r in rest] == [
        ("x", "chunk", pb.FINISH_REASON_LENGTH)
    ]
    assert session.num_live_requests == 0


def test_a_refused_request_sent_again_at_once_under_its_id_is_served(server: ServerThread) -> None:
    """The same through the real server, as a client does it: each retry is written the moment the
    refusal is read."""

    async def run() -> list[tuple[str, str]]:
        outcomes = []
        async with grpc.aio.insecure_channel(server.target) as channel:
            call = pb_grpc.InferenceServiceStub(channel).StreamGenerate(timeout=PATIENCE_S)
            for _ in range(NUM_RETRIES):
                await call.write(_generate("x", -1.0))
                refused = await call.read()
                outcomes.append((refused.request_id, status_code(refused.error.code).name))
                await call.write(_generate("x", 0.0))
                while not (response := await call.read()).chunk.finish_reason:
                    assert response.WhichOneof("event") == "chunk", response
                outcomes.append((response.request_id, pb.FinishReason.Name(response.chunk.finish_reason)))
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
        return outcomes

    assert asyncio.run(run()) == [("x", "INVALID_ARGUMENT"), ("x", "FINISH_REASON_LENGTH")] * NUM_RETRIES
    server.wait_idle()
