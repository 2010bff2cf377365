"""Operating the server: health while loading and draining, drain semantics, reflection, API keys."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from service_harness import (
    PATIENCE_S,
    UNENDING,
    ServerThread,
    long_engine_config,
    tiny_engine_config,
    wait_for,
)
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from toolchains import BUF, require

from sluice import Client, SluiceError, generate_request
from sluice.engine.faults import ENV_VAR as FAULT_VAR
from sluice.engine.frontend import async_engine
from sluice.engine.frontend.async_engine import TOKENIZE_INLINE_MAX_CHARS
from sluice.service import server as server_module
from sluice.service.server import GOAWAY_SETTLE_S, ServerConfig, SluiceServer
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(120)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
MISSING_KEY = "authorization: missing; send 'authorization: Bearer <api key>' metadata"
INVALID_KEY = "authorization: invalid API key"


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _generate_error(client: Client, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(SluiceError) as info:
        client.complete(request)
    return info.value.code, info.value.message


def test_health_follows_loading_then_serving(llama_dir: str) -> None:
    thread = ServerThread(tiny_engine_config(llama_dir)).start(attach=False)
    try:
        # No service config: the calls reach the loading server (the default one would not pick an
        # unhealthy server at all, see test_the_default_client_does_not_pick_a_loading_server).
        with thread.channel() as channel, Client(thread.target, service_config=None) as client:
            assert _health(channel) == NOT_SERVING
            assert _health(channel, "sluice.v1.InferenceService") == NOT_SERVING
            loading = (UNAVAILABLE, "the server is still loading the model")
            assert _generate_error(client, generate_request("hi")) == loading
            thread.attach()
            assert _health(channel) == SERVING
            assert _health(channel, "sluice.v1.InferenceService") == SERVING
            assert client.complete(generate_request("hi", max_tokens=2)).usage.completion_tokens > 0
    finally:
        thread.stop()


def test_the_default_client_does_not_pick_a_loading_server(llama_dir: str) -> None:
    thread = ServerThread(tiny_engine_config(llama_dir)).start(attach=False)
    try:
        with Client(thread.target) as client:
            code, message = _generate_error(client, generate_request("hi"))
            assert code == UNAVAILABLE and message.endswith("backend unhealthy")
            thread.attach()
            assert client.complete(generate_request("hi", max_tokens=2)).usage.completion_tokens > 0
    finally:
        thread.stop()


def test_drain_lets_in_flight_requests_finish(llama_long_dir: str) -> None:
    """One sequence runs at a time: a 60-token request waits behind one that runs until the test cancels
    it, so it is surely in flight when the drain begins; it then runs to its length."""
    thread = ServerThread(long_engine_config(llama_long_dir, max_num_seqs=1)).start()
    try:
        with Client(thread.target, service_config=None) as client, thread.channel() as channel:
            holder = client.generate(generate_request("Hold", **UNENDING))
            next(holder)
            # The client's generate() starts its call at once, as a stub's does.
            request = generate_request("Hello", temperature=0.0, max_tokens=60, ignore_eos=True)
            in_flight = thread.stub(channel).Generate(request)
            wait_for(lambda: thread.stats().num_waiting == 1, "the request waiting behind the holder")
            drained = asyncio.run_coroutine_threadsafe(thread.server.drain(grace_period=300.0), thread.loop)
            # GOAWAY at once and the listener closed: new calls fail to connect (UNAVAILABLE, which
            # the documented service config retries on another replica).
            _wait_for_unavailable(client)
            with pytest.raises(SluiceError) as info:
                client.tokenize("new")
            assert info.value.code == UNAVAILABLE
            holder.close()  # cancels the call
            chunks = list(in_flight)
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert sum(len(c.token_ids) for c in chunks) == 60
            drained.result(timeout=PATIENCE_S)  # well before the 300 s grace period
    finally:
        thread.stop()


def _wait_for_unavailable(client: Client) -> None:
    """New calls get UNAVAILABLE: from the draining servicer until the GOAWAY lands, then from the
    closed listener."""
    code, _ = _generate_error(client, generate_request("new"))
    assert code == UNAVAILABLE


def test_drain_sends_goaway_at_once(llama_long_dir: str) -> None:
    """A connected client learns of the drain from health (NOT_SERVING first) and then from the GOAWAY,
    long before the grace period ends: its channel leaves READY although a request still runs (one that
    runs until the test cancels it). The GOAWAY is held until the test has seen the channel READY after
    the notice (the drain's notice is 0.5 s, which a busy machine could let pass between the two reads)."""
    grace_period = 300.0
    thread = ServerThread(long_engine_config(llama_long_dir)).start()
    notice_read = threading.Event()
    wait_for_quiet = thread.server.arrivals.wait_for_quiet

    async def held_for_the_test(*args, **kwargs) -> bool:
        await asyncio.to_thread(notice_read.wait, PATIENCE_S)
        return await wait_for_quiet(*args, **kwargs)

    thread.server.arrivals.wait_for_quiet = held_for_the_test
    try:
        with thread.channel() as channel:
            stub = thread.stub(channel)
            in_flight = stub.Generate(generate_request("Hello", **UNENDING))
            next(in_flight)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert next(watch).status == SERVING
            assert channel._channel.check_connectivity_state(False) == 2  # READY
            drained = asyncio.run_coroutine_threadsafe(
                thread.server.drain(grace_period=grace_period), thread.loop
            )
            assert next(watch).status == NOT_SERVING
            assert channel._channel.check_connectivity_state(False) == 2  # the notice before the GOAWAY
            notice_read.set()
            wait_for(lambda: channel._channel.check_connectivity_state(False) != 2, "the GOAWAY")
            assert thread.stats().num_running == 1  # the request still runs
            in_flight.cancel()
            # Neither the cancelled request nor the open Watch stream holds the drain for its grace period.
            drained.result(timeout=PATIENCE_S)
    finally:
        notice_read.set()
        thread.stop()


def test_drain_aborts_what_outlives_the_grace_period(llama_long_dir: str) -> None:
    thread = ServerThread(long_engine_config(llama_long_dir)).start()
    try:
        with Client(thread.target) as client:
            in_flight = client.generate(generate_request("Hello", **UNENDING))
            next(in_flight)
            # The request runs until something ends it: here the end of the grace period.
            drained = asyncio.run_coroutine_threadsafe(thread.server.drain(grace_period=0.02), thread.loop)
            last = list(in_flight)[-1]
            assert last.finish_reason == pb.FINISH_REASON_ABORT
            assert last.usage.completion_tokens < UNENDING["max_tokens"]
            drained.result(timeout=PATIENCE_S)
            thread.wait_idle()
    finally:
        thread.stop()


def test_the_drain_ends_what_it_aborts_at_once_while_the_cores_step_runs_on(
    llama_long_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the grace period an aborted request's stream ends with FINISH_REASON_ABORT at once: it
    waited for the core's answer, a step later, and a step longer than the drain's margin (ABORT_MARGIN_S;
    a long prompt's chunk on a CPU takes seconds) left the call to grpc's stop: UNAVAILABLE, "Cancelling
    all calls", after its tokens. Here the request's first step runs busy for SLOW_STEP_S."""
    monkeypatch.setenv(FAULT_VAR, "busy:held")
    thread = ServerThread(long_engine_config(llama_long_dir)).start()
    try:
        in_step = threading.Event()  # the core said it is busy in a step: CoreBusy
        core_client = thread.server.servicer.runner.engine._client
        monkeypatch.setattr(core_client, "_log_long_step", lambda step_seconds: in_step.set())
        with thread.channel() as channel:
            request = generate_request("Hello", request_id="held", **UNENDING)
            in_flight = thread.stub(channel).Generate(request)
            assert in_step.wait(PATIENCE_S)
            drained = asyncio.run_coroutine_threadsafe(thread.server.drain(grace_period=0.02), thread.loop)
            last = list(in_flight)[-1]
            assert last.finish_reason == pb.FINISH_REASON_ABORT
            drained.result(timeout=PATIENCE_S)
        thread.wait_idle()
    finally:
        thread.stop()


def test_drain_aborts_a_request_whose_long_prompt_is_still_being_tokenized(
    llama_long_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the grace period the drain aborted only the requests in the engine: one whose long prompt was
    still being tokenized (off the event loop) reached it after that, ran, and its call was cancelled
    with no abort chunk. Here the tokenizer holds that prompt until the drain has aborted."""
    tokenizing, aborted = threading.Event(), threading.Event()
    resolve_prompt = async_engine.resolve_prompt

    def held_resolve_prompt(*args, **kwargs):
        tokenizing.set()
        assert aborted.wait(PATIENCE_S)
        return resolve_prompt(*args, **kwargs)

    monkeypatch.setattr(async_engine, "resolve_prompt", held_resolve_prompt)
    thread = ServerThread(long_engine_config(llama_long_dir)).start()
    try:
        runner = thread.server.servicer.runner
        abort_all = runner.abort_all

        async def abort_all_then_release() -> int:
            num_aborted = await abort_all()
            aborted.set()
            return num_aborted

        monkeypatch.setattr(runner, "abort_all", abort_all_then_release)
        prompt = "the quick brown fox jumps over the lazy dog " * (TOKENIZE_INLINE_MAX_CHARS // 40)
        with thread.channel() as channel:
            in_flight = thread.stub(channel).Generate(generate_request(prompt, max_tokens=8, ignore_eos=True))
            assert tokenizing.wait(PATIENCE_S)
            drained = asyncio.run_coroutine_threadsafe(thread.server.drain(grace_period=0.02), thread.loop)
            last = list(in_flight)[-1]
            assert last.finish_reason == pb.FINISH_REASON_ABORT
            assert last.usage.completion_tokens < 8
            drained.result(timeout=PATIENCE_S)
            thread.wait_idle()
    finally:
        aborted.set()
        thread.stop()


class _GrpcServerWithAWatch:
    """grpc.aio.Server's stop() as a server with one call that never ends (a health Watch) answers it: a
    graceful stop returns once stop(0) cancels that call, or at once when `open_call` is False."""

    def __init__(self, open_call: bool) -> None:
        self.stops: list[tuple[float | None, float]] = []  # (grace, time.monotonic() at the call)
        self.cancelled = asyncio.Event()
        if not open_call:
            self.cancelled.set()

    async def stop(self, grace: float | None) -> None:
        self.stops.append((grace, time.monotonic()))
        if grace == 0:
            self.cancelled.set()
        await self.cancelled.wait()


def _drain(grpc_server: _GrpcServerWithAWatch) -> None:
    async def drain() -> None:
        server = SluiceServer(ServerConfig(host="127.0.0.1", port=0))
        server._server = grpc_server
        await asyncio.wait_for(server.drain(grace_period=5.0), timeout=60)

    asyncio.run(drain())


def test_the_drain_cancels_the_calls_left_open_a_settle_after_the_goaway() -> None:
    """No request is left when the GOAWAY goes out, but a Watch stream is: grpc's stop(0) cancels it
    GOAWAY_SETTLE_S later, not at once, so that calls already under way end as they would have."""
    grpc_server = _GrpcServerWithAWatch(open_call=True)
    _drain(grpc_server)
    (grace, goaway_at), (zero, cancelled_at) = grpc_server.stops
    assert grace > 0 and zero == 0
    assert cancelled_at - goaway_at >= GOAWAY_SETTLE_S - 0.01  # asyncio may wake a little early


def test_the_drain_does_not_wait_out_the_settle_once_no_call_is_open(monkeypatch) -> None:
    """With nothing left open the graceful stop (the GOAWAY, first) ends by itself and the drain goes on
    (a settle of 10 minutes would fail the test's 60 s bound)."""
    monkeypatch.setattr(server_module, "GOAWAY_SETTLE_S", 600.0)
    grpc_server = _GrpcServerWithAWatch(open_call=False)
    _drain(grpc_server)
    graces = [grace for grace, _ in grpc_server.stops]
    assert graces[0] > 0 and graces[1:] == [0]


@pytest.fixture(scope="module")
def keyed_server(llama_dir: str):
    thread = ServerThread(
        tiny_engine_config(llama_dir), ServerConfig(host="127.0.0.1", port=0, api_key="s3cret")
    )
    thread.start()
    yield thread
    thread.stop()


def test_reflection_lists_the_services(keyed_server: ServerThread) -> None:
    with keyed_server.channel() as channel:
        # Reflection needs the key too; the reflection client cannot send metadata, so use an interceptor.
        authed = grpc.intercept_channel(channel, _BearerInterceptor("s3cret"))
        database = ProtoReflectionDescriptorDatabase(authed)
        assert set(database.get_services()) == {
            "sluice.v1.InferenceService",
            "vllm.grpc.engine.VllmEngine",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        service = DescriptorPool(database).FindServiceByName("sluice.v1.InferenceService")
        methods = {m.name: (m.input_type.full_name, m.output_type.full_name) for m in service.methods}
    assert methods == {
        "Generate": ("sluice.v1.GenerateRequest", "sluice.v1.GenerateResponse"),
        "StreamGenerate": ("sluice.v1.StreamGenerateRequest", "sluice.v1.StreamGenerateResponse"),
        "Abort": ("sluice.v1.AbortRequest", "sluice.v1.AbortResponse"),
        "Tokenize": ("sluice.v1.TokenizeRequest", "sluice.v1.TokenizeResponse"),
        "GetModelInfo": ("sluice.v1.GetModelInfoRequest", "sluice.v1.GetModelInfoResponse"),
    }


@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
def test_buf_curl_calls_through_either_reflection_protocol(keyed_server: ServerThread, protocol: str) -> None:
    """`buf curl` (as the README calls the server) with only one reflection protocol: v1 found no service
    when grpcio-reflection served v1alpha alone."""
    require("buf")
    base = f"http://{keyed_server.target}"
    flags = ["--protocol", "grpc", "--http2-prior-knowledge", "--reflect-protocol", protocol]
    flags += ["--reflect-header", "authorization: Bearer s3cret", "-H", "authorization: Bearer s3cret"]

    def buf_curl(*args: str) -> str:
        done = subprocess.run([BUF, "curl", *flags, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    info = json.loads(buf_curl(f"{base}/sluice.v1.InferenceService/GetModelInfo"))
    assert (info["blockSize"], info["numKvBlocks"]) == (16, 128)  # tiny_engine_config's cache
    methods = buf_curl("--list-methods", base).split()
    assert "grpc.reflection.v1.ServerReflection/ServerReflectionInfo" in methods
    assert "sluice.v1.InferenceService/StreamGenerate" in methods


def test_api_key_is_required_except_for_health(keyed_server: ServerThread) -> None:
    request = generate_request("hi", max_tokens=2)
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    with Client(keyed_server.target) as client:
        assert _generate_error(client, request) == (unauthenticated, MISSING_KEY)
        with pytest.raises(SluiceError) as info:
            client.model_info()
        assert (info.value.code, info.value.message) == (unauthenticated, MISSING_KEY)
    with Client(keyed_server.target, api_key="wrong") as client:
        assert _generate_error(client, request) == (unauthenticated, INVALID_KEY)
        with pytest.raises(SluiceError) as info:
            list(client.stream_generate([pb.StreamGenerateRequest(generate=request)]))
        assert (info.value.code, info.value.message) == (unauthenticated, INVALID_KEY)
    with Client(keyed_server.target, api_key="s3cret") as client:
        assert client.complete(request).finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert client.model_info().vocab_size == 512
    with keyed_server.channel() as channel:
        assert _health(channel) == SERVING


def test_calls_refused_for_their_key_are_counted_by_method(keyed_server: ServerThread) -> None:
    """Refused by the interceptor before any handler ran, as those the generation handlers refuse are."""
    registry = keyed_server.server.metrics.registry

    def count(method: str) -> float:
        labels = {"method": method, "code": "UNAUTHENTICATED"}
        return registry.get_sample_value("sluice_rpc_requests_total", labels) or 0.0

    methods = ("GetModelInfo", "Tokenize", "Generate")
    before = {method: count(method) for method in methods}
    with Client(keyed_server.target, api_key="wrong") as client:
        with pytest.raises(SluiceError):
            client.model_info()
        with pytest.raises(SluiceError):
            client.tokenize("hi")
        _generate_error(client, generate_request("hi", max_tokens=2))
    assert {method: count(method) - before[method] for method in methods} == dict.fromkeys(methods, 1)
    # SMG's methods as its handlers count theirs, "VllmEngine.<method>": a refused GetModelInfo was
    # counted as sluice.v1's.
    smg_methods = ("VllmEngine.GetModelInfo", "VllmEngine.GetLoads", "GetModelInfo")
    before = {method: count(method) for method in smg_methods}
    with grpc.insecure_channel(keyed_server.target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        wrong = (("authorization", "Bearer wrong"),)
        for call, request in (
            (stub.GetModelInfo, vllm_engine_pb2.GetModelInfoRequest()),
            (stub.GetLoads, vllm_engine_pb2.GetLoadsRequest()),
        ):
            with pytest.raises(grpc.RpcError):
                call(request, metadata=wrong, timeout=PATIENCE_S)
    assert {method: count(method) - before[method] for method in smg_methods} == {
        "VllmEngine.GetModelInfo": 1,
        "VllmEngine.GetLoads": 1,
        "GetModelInfo": 0,
    }


def test_streaming_calls_without_their_key_are_refused_before_sending_anything(
    keyed_server: ServerThread,
) -> None:
    """The interceptor's stream handlers: reflection (a bidirectional stream) and SMG's GetTokenizer and
    SubscribeKvEvents (server streams) end UNAUTHENTICATED with no key or a wrong one, no response sent;
    with the key, reflection answers."""
    list_services = reflection_pb2.ServerReflectionRequest(list_services="")
    with keyed_server.channel() as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        smg = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        calls = {
            "ServerReflectionInfo": lambda metadata: reflection.ServerReflectionInfo(
                iter([list_services]), metadata=metadata, timeout=PATIENCE_S
            ),
            "GetTokenizer": lambda metadata: smg.GetTokenizer(
                common_pb2.GetTokenizerRequest(), metadata=metadata, timeout=PATIENCE_S
            ),
            "SubscribeKvEvents": lambda metadata: smg.SubscribeKvEvents(
                common_pb2.SubscribeKvEventsRequest(), metadata=metadata, timeout=PATIENCE_S
            ),
        }
        for name, call in calls.items():
            for metadata, details in (
                ((), MISSING_KEY),
                ((("authorization", "Bearer wrong"),), INVALID_KEY),
            ):
                responses = []
                with pytest.raises(grpc.RpcError) as info:
                    for response in call(metadata):
                        responses.append(response)
                outcome = (info.value.code(), info.value.details(), responses)
                assert outcome == (grpc.StatusCode.UNAUTHENTICATED, details, []), name
        (answer,) = calls["ServerReflectionInfo"]((("authorization", "Bearer s3cret"),))
    assert "sluice.v1.InferenceService" in {service.name for service in answer.list_services_response.service}


class _BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <key>` to calls made by clients that take no metadata argument."""

    def __init__(self, key: str) -> None:
        self._metadata = (("authorization", f"Bearer {key}"),)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return details._replace(metadata=(*(details.metadata or ()), *self._metadata))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
