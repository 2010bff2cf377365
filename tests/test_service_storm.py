"""Reliability storm: 1,000 requests against one real server with random gRPC deadlines, client
cancels, in-band cancels, per-request timeouts, Aborts (before, during and after their Generate),
duplicate ids and malformed input (non-finite floats among it). Afterwards nothing runs, nothing waits,
no KV block is held, no request id is live, and no call ever ended INTERNAL or UNKNOWN."""

from __future__ import annotations

import asyncio
import math
import random

import grpc
import pytest
from service_harness import ServerThread, drain, status_code, tiny_engine_config

from sluice import generate_request
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(600)
# The storm takes seconds; a hang fails it after this, naming the calls still open, well before a call could
# outlive the server's max_connection_age (300 s +-10%) + grace (120 s) and fail as UNAVAILABLE instead.
STORM_PATIENCE_S = 240.0

NUM_REQUESTS = 1000
CONCURRENCY = 32
CODE = grpc.StatusCode
# Status codes each kind of request may end with; anything else fails the test.
ALLOWED = {
    "deadline": {CODE.OK, CODE.DEADLINE_EXCEEDED},
    "cancel": {CODE.OK, CODE.CANCELLED},
    "timeout": {CODE.OK, CODE.DEADLINE_EXCEEDED},
    "abort": {CODE.OK, CODE.NOT_FOUND},
    "duplicate": {CODE.OK, CODE.ALREADY_EXISTS},
    "malformed": {CODE.INVALID_ARGUMENT},
    "stream": {CODE.OK, CODE.DEADLINE_EXCEEDED},
}
MALFORMED = [
    generate_request("x", temperature=math.inf),
    generate_request("x", top_p=math.nan),
    generate_request("x", repetition_penalty=-math.inf),
    generate_request("x", timeout_seconds=-1.0),
    generate_request("x", timeout_seconds=math.nan),
    generate_request(""),
    generate_request(token_ids=[5, 10_000]),
    generate_request("x", max_tokens=0),
]
MALFORMED[0].sampling_params.logit_bias[3] = math.inf


def _request(rng: random.Random, request_id: str = "", **extra: object) -> pb.GenerateRequest:
    return generate_request(
        f"storm {rng.randrange(1000)}",
        request_id=request_id,
        temperature=rng.choice([0.0, 0.8]),
        max_tokens=rng.randint(1, 24),
        ignore_eos=True,
        **extra,
    )


async def _one(
    stub: pb_grpc.InferenceServiceStub, index: int, rng: random.Random, open_calls: dict[int, str]
) -> tuple[str, set[CODE]]:
    kind = rng.choice(list(ALLOWED))
    open_calls[index] = kind
    codes: set[CODE] = set()
    if kind == "deadline":
        codes.add(await drain(stub.Generate(_request(rng), timeout=rng.uniform(0.01, 1.0))))
    elif kind == "cancel":
        call = stub.Generate(_request(rng))
        await asyncio.sleep(rng.uniform(0, 0.05))
        call.cancel()
        codes.add(await drain(call))
    elif kind == "timeout":
        codes.add(await drain(stub.Generate(_request(rng, timeout_seconds=rng.uniform(0.001, 0.3)))))
    elif kind == "abort":
        request_id = f"abort-{index}"
        call = stub.Generate(_request(rng, request_id))
        await asyncio.sleep(rng.uniform(0, 0.05))
        try:
            await stub.Abort(pb.AbortRequest(request_id=request_id))
        except grpc.aio.AioRpcError as error:
            codes.add(error.code())  # NOT_FOUND: the Abort came first; it is remembered
        codes.add(await drain(call))
    elif kind == "duplicate":
        request_id = f"dup-{index}"
        calls = [stub.Generate(_request(rng, request_id)) for _ in range(2)]
        codes.update(await asyncio.gather(*(drain(c) for c in calls)))
    elif kind == "malformed":
        codes.add(await drain(stub.Generate(rng.choice(MALFORMED))))
    else:
        codes.update(await _stream(stub, rng))
    return kind, codes


async def _stream(stub: pb_grpc.InferenceServiceStub, rng: random.Random) -> set[CODE]:
    """Three requests on one stream: one cancelled in-band, one with a short timeout."""
    requests = [
        pb.StreamGenerateRequest(generate=_request(rng, "a")),
        pb.StreamGenerateRequest(generate=_request(rng, "b", timeout_seconds=rng.uniform(0.001, 0.2))),
        pb.StreamGenerateRequest(generate=_request(rng, "c")),
        pb.StreamGenerateRequest(cancel=pb.StreamCancel(request_id="a")),
    ]
    codes = {CODE.OK}
    async for response in stub.StreamGenerate(iter(requests)):
        if response.WhichOneof("event") == "error":
            codes.add(status_code(response.error.code))
    return codes


async def _storm(server: ServerThread) -> dict[str, set[CODE]]:
    rng = random.Random(20261123)
    seen: dict[str, set[CODE]] = {kind: set() for kind in ALLOWED}
    semaphore = asyncio.Semaphore(CONCURRENCY)
    open_calls: dict[int, str] = {}
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        async def bounded(index: int) -> None:
            async with semaphore:
                open_calls[index] = "started"
                kind, codes = await _one(stub, index, random.Random(rng.random()), open_calls)
                seen[kind] |= codes
                del open_calls[index]

        calls = asyncio.ensure_future(asyncio.gather(*(bounded(i) for i in range(NUM_REQUESTS))))
        done, _ = await asyncio.wait({calls}, timeout=STORM_PATIENCE_S)
        if not done:  # named before cancelling: a cancelled call ends (CANCELLED) and leaves open_calls
            engine = f"engine {server.stats()}, live requests {server.engine.live_request_ids()}"
            hung = f"calls still open {open_calls}; {engine}"
            calls.cancel()
            raise AssertionError(f"the storm did not end in {STORM_PATIENCE_S:.0f} s: {hung}")
        calls.result()
    return seen


def test_storm_leaves_nothing_behind_and_never_fails_internally(llama_dir: str) -> None:
    server = ServerThread(tiny_engine_config(llama_dir)).start()
    try:
        seen = asyncio.run(_storm(server))
        for kind, codes in seen.items():
            assert codes <= ALLOWED[kind], f"{kind}: unexpected {codes - ALLOWED[kind]}"
        assert seen["malformed"] == {CODE.INVALID_ARGUMENT}
        assert CODE.DEADLINE_EXCEEDED in seen["timeout"] and CODE.OK in seen["abort"]
        stats = server.wait_idle()
        assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
        servicer = server.server.servicer
        assert servicer.num_active_requests == 0
        assert servicer._request_ids.num_live == 0
        internal = server.server.metrics.registry.get_sample_value
        for method in ("Generate", "StreamGenerate", "StreamGenerate.request", "Abort"):
            for code in ("INTERNAL", "UNKNOWN"):
                assert not internal("sluice_rpc_requests_total", {"method": method, "code": code})
    finally:
        server.stop()
