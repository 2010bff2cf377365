"""A StreamGenerate call refused at once (loading, draining, wrong API key) ends with the server's status
and message on a grpc.aio client, however that client writes. Before service/stream_refusal.py the
client's in-flight write lost to the server's trailers and about 1 call in 8 ended INTERNAL
"Internal error from Core" (grpc/grpc#36066), so each case repeats the call many times."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

import grpc
import pytest
from service_harness import ServerThread, tiny_engine_config

from sluice import generate_request
from sluice.service.server import ServerConfig
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)  # a hang's bound: one wait alone may take PATIENCE_S (60 s)

Outcome = tuple[grpc.StatusCode, str]
Caller = Callable[[pb_grpc.InferenceServiceStub, tuple[tuple[str, str], ...]], Awaitable[Outcome]]

LOADING = (grpc.StatusCode.UNAVAILABLE, "the server is still loading the model")
DRAINING = (grpc.StatusCode.UNAVAILABLE, "the server is draining and accepts no new requests")
NUM_CALLS = 50  # a race lost 1 time in 8 survives 50 calls with odds below 1 in 700
NUM_OPEN_CALLS = 3  # each waits out the server's quiet period
REQUEST = pb.StreamGenerateRequest(generate=generate_request("hi", request_id="1", max_tokens=2))


async def _status(call: grpc.aio.StreamStreamCall) -> Outcome:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in call:
            raise AssertionError(f"a refused call sent a response: {response}")
    return info.value.code(), info.value.details()


async def one_request_then_half_close(stub: pb_grpc.InferenceServiceStub, metadata) -> Outcome:
    """As `sluice.AsyncClient.stream_generate` does with a list of requests."""
    return await _status(stub.StreamGenerate(iter([REQUEST]), metadata=metadata))


async def burst_of_writes_then_half_close(stub: pb_grpc.InferenceServiceStub, metadata) -> Outcome:
    call = stub.StreamGenerate(metadata=metadata)
    for _ in range(5):
        await call.write(REQUEST)  # raises if the server ended the call while the client still wrote
    await call.done_writing()
    return await _status(call)


async def write_and_keep_open(stub: pb_grpc.InferenceServiceStub, metadata) -> Outcome:
    """A client that waits for responses before it writes more or half-closes."""
    call = stub.StreamGenerate(metadata=metadata)
    await call.write(REQUEST)
    return await _status(call)


def _outcomes(target: str, caller: Caller, num_calls: int, metadata=()) -> Counter[Outcome]:
    """How many of `num_calls` sequential calls ended with each (code, details)."""

    async def run() -> Counter[Outcome]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            return Counter([await caller(stub, tuple(metadata)) for _ in range(num_calls)])

    return asyncio.run(run())


def _num_unavailable(thread: ServerThread) -> float | None:
    labels = {"method": "StreamGenerate", "code": "UNAVAILABLE"}
    return thread.server.metrics.registry.get_sample_value("sluice_rpc_requests_total", labels)


CALLERS = [
    (one_request_then_half_close, NUM_CALLS),
    (burst_of_writes_then_half_close, NUM_CALLS),
    (write_and_keep_open, NUM_OPEN_CALLS),
]
CALLER_IDS = [caller.__name__ for caller, _ in CALLERS]


@pytest.fixture(scope="module")
def loading_server(llama_dir: str):
    thread = ServerThread(tiny_engine_config(llama_dir)).start(attach=False)
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def draining_server(llama_dir: str):
    thread = ServerThread(tiny_engine_config(llama_dir)).start()
    thread.call(thread.server.begin_drain())
    yield thread
    thread.stop()


@pytest.mark.parametrize(("caller", "num_calls"), CALLERS, ids=CALLER_IDS)
def test_refused_while_loading(loading_server: ServerThread, caller: Caller, num_calls: int) -> None:
    before = _num_unavailable(loading_server) or 0.0
    assert _outcomes(loading_server.target, caller, num_calls) == {LOADING: num_calls}
    assert _num_unavailable(loading_server) == before + num_calls


@pytest.mark.parametrize(("caller", "num_calls"), CALLERS, ids=CALLER_IDS)
def test_refused_while_draining(draining_server: ServerThread, caller: Caller, num_calls: int) -> None:
    before = _num_unavailable(draining_server) or 0.0
    assert _outcomes(draining_server.target, caller, num_calls) == {DRAINING: num_calls}
    assert _num_unavailable(draining_server) == before + num_calls


def test_refused_for_a_wrong_api_key(llama_dir: str) -> None:
    config = ServerConfig(host="127.0.0.1", port=0, api_key="s3cret")
    thread = ServerThread(tiny_engine_config(llama_dir), config).start(attach=False)
    try:
        wrong_key = (("authorization", "Bearer wrong"),)
        denied = (grpc.StatusCode.UNAUTHENTICATED, "authorization: invalid API key")
        for caller, num_calls in CALLERS:
            assert _outcomes(thread.target, caller, num_calls, wrong_key) == {denied: num_calls}
    finally:
        thread.stop()
