"""A generation call refused before its request's span could start has its one span too, as OTel's gRPC
server conventions expect of every RPC: refused while the model loads, while the server drains, for an
unknown API key, for a request id in use or too long, on sluice.v1 (Generate, StreamGenerate) and SMG's
vllm.grpc.engine (Generate). Each span is a SERVER span with status ERROR, its description the message
the caller got, `rpc.grpc.status_code` the code it got and `error.type` the refusal's class. A
StreamGenerate call refused whole has one span for the call, named "{rpc.service}/{rpc.method}" (no
request was read); a StreamGenerate request refused in-band has one for the request, continuing the
request's own trace_context."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from service_harness import UNENDING, UNENDING_TOKENS, ServerThread, long_engine_config, tiny_engine_config
from service_harness import wait_for as wait_until
from smg_grpc_proto import vllm_engine_pb2_grpc as smg_grpc
from test_service_spans import _smg_request

from sluice import generate_request
from sluice.service.server import ServerConfig
from sluice.service.tenants import TenantDirectory
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

OPEN = (("authorization", "Bearer key-open"),)
WRONG_KEY = (("authorization", "Bearer wrong"),)
SLUICE = "sluice.v1.InferenceService"
SMG = "vllm.grpc.engine.VllmEngine"
LOADING = (grpc.StatusCode.UNAVAILABLE, "the server is still loading the model")
DRAINING = (grpc.StatusCode.UNAVAILABLE, "the server is draining and accepts no new requests")
DENIED = (grpc.StatusCode.UNAUTHENTICATED, "authorization: invalid API key")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACE_CONTEXT = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}

Metadata = tuple[tuple[str, str], ...]
Outcome = tuple[grpc.StatusCode, str]


def _outcome(responses: Callable[[], Iterator[object]]) -> Outcome:
    """The status of a call that must be refused without a response."""
    with pytest.raises(grpc.RpcError) as info:
        for response in responses():
            raise AssertionError(f"a refused call sent a response: {response}")
    return info.value.code(), info.value.details()


def sluice_generate(target: str, metadata: Metadata, request_id: str = "") -> Outcome:
    request = generate_request("hi", request_id=request_id, max_tokens=2)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        return _outcome(lambda: stub.Generate(request, metadata=metadata))


def sluice_stream_generate(target: str, metadata: Metadata) -> Outcome:
    request = pb.StreamGenerateRequest(generate=generate_request("hi", request_id="1", max_tokens=2))
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        return _outcome(lambda: stub.StreamGenerate(iter([request]), metadata=metadata))


def smg_generate(target: str, metadata: Metadata, request_id: str = "") -> Outcome:
    with grpc.insecure_channel(target) as channel:
        stub = smg_grpc.VllmEngineStub(channel)
        return _outcome(lambda: stub.Generate(_smg_request(request_id, max_tokens=2), metadata=metadata))


# (the call, its span's name while the model loads, rpc.service, rpc.method)
WHOLE_CALLS = [
    (sluice_generate, "text_completion", SLUICE, "Generate"),
    (sluice_stream_generate, f"{SLUICE}/StreamGenerate", SLUICE, "StreamGenerate"),
    (smg_generate, "text_completion", SMG, "Generate"),
]
WHOLE_CALL_IDS = ["Generate", "StreamGenerate", "smg-Generate"]


def _once_loaded(name: str, method: str, model: str) -> str:
    """A WHOLE_CALLS span name once `model` is loaded: "{operation} {model}"; a StreamGenerate call refused
    whole keeps its RPC name."""
    return name if method == "StreamGenerate" else f"{name} {model}"


def _server(engine_config, keys: TenantDirectory) -> ServerThread:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    config = ServerConfig(host="127.0.0.1", port=0, tenants=keys)
    thread = ServerThread(engine_config, config, tracer_provider=provider)
    thread.memory = memory
    return thread


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> TenantDirectory:
    path = Path(tmp_path_factory.mktemp("keys")) / "api-keys.toml"
    path.write_text('[[tenant]]\nname = "open"\nkeys = ["key-open"]\n')
    return TenantDirectory.load(path)


@pytest.fixture(scope="module")
def loading(llama_dir: str, keys: TenantDirectory):
    """A server whose engine never attaches: it answers every generation call UNAVAILABLE."""
    thread = _server(tiny_engine_config(llama_dir), keys).start(attach=False)
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def serving(llama_long_dir: str, keys: TenantDirectory):
    thread = _server(long_engine_config(llama_long_dir), keys).start()
    yield thread
    thread.stop()


def _spans(server: ServerThread, count: int) -> list:
    """The spans ended since the test cleared them, once there are `count`. A refusal's span ends before its
    handler answers, so by then every span of the call is there: exactly `count`."""
    wait_until(lambda: len(server.memory.get_finished_spans()) >= count, f"{count} spans")
    spans = list(server.memory.get_finished_spans())
    assert len(spans) == count, [span.name for span in spans]
    return spans


def _refusal(span) -> tuple[str, str, str, str, int, str]:
    """name, rpc.service, rpc.method, status description, rpc.grpc.status_code, error.type."""
    assert span.kind == SpanKind.SERVER and span.status.status_code == StatusCode.ERROR
    attributes = dict(span.attributes)
    return (
        span.name,
        attributes["rpc.service"],
        attributes["rpc.method"],
        span.status.description,
        attributes["rpc.grpc.status_code"],
        attributes["error.type"],
    )


@pytest.mark.parametrize(("metadata", "refused", "error_type"), [
    (OPEN, LOADING, "ServiceUnavailableError"),
    (WRONG_KEY, DENIED, "UnauthenticatedError"),  # the key is checked first, as the interceptor did
], ids=["loading", "unauthenticated"])  # fmt: skip
@pytest.mark.parametrize(("call", "name", "service", "method"), WHOLE_CALLS, ids=WHOLE_CALL_IDS)
def test_a_call_refused_while_the_model_loads_has_one_span(
    loading: ServerThread, call, name, service, method, metadata, refused, error_type
) -> None:
    """No model yet: a span named by its operation alone, without gen_ai.request.model."""
    loading.memory.clear()
    code, message = call(loading.target, metadata)
    assert (code, message) == refused
    (span,) = _spans(loading, 1)
    assert _refusal(span) == (name, service, method, message, code.value[0], error_type)
    assert "gen_ai.request.model" not in dict(span.attributes)


@pytest.mark.parametrize(("call", "name", "service", "method"), WHOLE_CALLS, ids=WHOLE_CALL_IDS)
def test_an_unauthenticated_call_has_one_span(serving: ServerThread, call, name, service, method) -> None:
    serving.memory.clear()
    code, message = call(serving.target, WRONG_KEY)
    assert (code, message) == DENIED
    (span,) = _spans(serving, 1)
    name = _once_loaded(name, method, serving.engine.model_info.name)
    assert _refusal(span) == (name, service, method, message, code.value[0], "UnauthenticatedError")


@pytest.mark.parametrize(
    ("call", "service"), [(sluice_generate, SLUICE), (smg_generate, SMG)], ids=["sluice", "smg"]
)
def test_a_request_id_too_long_has_one_span(serving: ServerThread, call, service) -> None:
    serving.memory.clear()
    code, message = call(serving.target, OPEN, "x" * 513)
    assert (code, message) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "request_id: must be at most 512 bytes (UTF-8), got 513",
    )
    (span,) = _spans(serving, 1)
    name = f"text_completion {serving.engine.model_info.name}"
    assert _refusal(span) == (name, service, "Generate", message, code.value[0], "InvalidRequestError")


def _start_sluice(channel: grpc.Channel, request_id: str) -> Iterator[object]:
    request = generate_request("Hello", request_id=request_id, **UNENDING)
    return pb_grpc.InferenceServiceStub(channel).Generate(request, metadata=OPEN)


def _start_smg(channel: grpc.Channel, request_id: str) -> Iterator[object]:
    request = _smg_request(request_id, temperature=0.0, max_tokens=UNENDING_TOKENS, ignore_eos=True)
    return smg_grpc.VllmEngineStub(channel).Generate(request, metadata=OPEN)


@pytest.mark.parametrize(("start", "call", "service"), [
    (_start_sluice, sluice_generate, SLUICE),
    (_start_smg, smg_generate, SMG),
], ids=["sluice", "smg"])  # fmt: skip
def test_a_request_id_in_use_has_one_span(serving: ServerThread, start, call, service) -> None:
    with serving.channel() as channel:
        running = start(channel, "dup")
        assert next(running)  # "dup" is live
        serving.memory.clear()
        code, message = call(serving.target, OPEN, "dup")
        assert (code, message) == (
            grpc.StatusCode.ALREADY_EXISTS,
            "request_id: 'dup' is already in use by a live request",
        )
        (span,) = _spans(serving, 1)
        name = f"text_completion {serving.engine.model_info.name}"
        assert _refusal(span) == (name, service, "Generate", message, code.value[0], "RequestIdInUseError")
        running.cancel()
    _spans(serving, 2)  # the running request's own span, ended: none is left to end in a later test


class _Stream:
    """A StreamGenerate call whose requests the test writes one at a time."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.Queue[pb.StreamGenerateRequest | None] = queue.Queue()
        stub = pb_grpc.InferenceServiceStub(channel)
        self.responses = stub.StreamGenerate(iter(self._requests.get, None), metadata=OPEN)

    def generate(self, **request: object) -> None:
        self._requests.put(pb.StreamGenerateRequest(generate=generate_request("hi", **request)))

    def cancel(self, request_id: str) -> None:
        self._requests.put(pb.StreamGenerateRequest(cancel=pb.StreamCancel(request_id=request_id)))

    def next_error(self) -> pb.RequestError:
        """The next in-band error, past the chunks of the requests running."""
        return next(response for response in self.responses if response.HasField("error")).error

    def finish(self, request_id: str) -> None:
        """Reads up to the last chunk of `request_id`."""
        next(r for r in self.responses if r.request_id == request_id and r.chunk.finish_reason)

    def close(self) -> None:
        """Half-closes and reads the call to its end (OK)."""
        self._requests.put(None)
        list(self.responses)


def test_a_stream_request_refused_in_band_has_one_span(serving: ServerThread) -> None:
    """One span per refused request (its id in use; no id), the call going on; the refused request's span
    continues the request's own trace_context."""
    serving.memory.clear()
    with serving.channel() as channel:
        stream = _Stream(channel)
        stream.generate(request_id="a", **UNENDING)
        assert next(stream.responses).chunk.token_ids  # "a" is live
        stream.generate(request_id="a", max_tokens=2, trace_context=TRACE_CONTEXT)
        in_use = stream.next_error()
        stream.generate(max_tokens=2)
        no_id = stream.next_error()
        stream.cancel("a")
        stream.close()
    spans = _spans(serving, 3)  # "a", and one per refused request
    refused = sorted((s for s in spans if "error.type" in dict(s.attributes)), key=lambda s: s.name)
    assert [s.name for s in refused] == [f"text_completion {serving.engine.model_info.name}"] * 2
    already_exists, invalid = (
        grpc.StatusCode.ALREADY_EXISTS.value[0],
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
    )
    assert sorted(_refusal(s)[1:] for s in refused) == [
        (SLUICE, "StreamGenerate", in_use.message, already_exists, "RequestIdInUseError"),
        (SLUICE, "StreamGenerate", no_id.message, invalid, "ValueError"),
    ]
    assert (in_use.code, no_id.code) == (already_exists, invalid)
    in_use_span = next(s for s in refused if dict(s.attributes)["error.type"] == "RequestIdInUseError")
    assert format(in_use_span.context.trace_id, "032x") == TRACE_ID


def test_calls_refused_while_the_server_drains_have_one_span_each(
    llama_dir: str, keys: TenantDirectory
) -> None:
    """A request on a StreamGenerate call accepted before the drain is refused in-band, with its span;
    a new call is refused whole, with one span."""
    server = _server(tiny_engine_config(llama_dir), keys).start()
    try:
        model = server.engine.model_info.name
        with server.channel() as channel:
            stream = _Stream(channel)
            stream.generate(request_id="first", max_tokens=2)
            stream.finish("first")
            _spans(server, 1)  # "first" ended
            server.call(server.server.begin_drain())
            server.memory.clear()
            stream.generate(request_id="second", max_tokens=2)
            refused = stream.next_error()
            stream.close()
        assert (refused.code, refused.message) == (DRAINING[0].value[0], DRAINING[1])
        (span,) = _spans(server, 1)
        assert _refusal(span) == (
            f"text_completion {model}",
            SLUICE,
            "StreamGenerate",
            DRAINING[1],
            DRAINING[0].value[0],
            "ServiceUnavailableError",
        )
        for call, name, service, method in WHOLE_CALLS:
            server.memory.clear()
            assert call(server.target, OPEN) == DRAINING
            (span,) = _spans(server, 1)
            name = _once_loaded(name, method, model)
            expected = (name, service, method, DRAINING[1], DRAINING[0].value[0], "ServiceUnavailableError")
            assert _refusal(span) == expected
    finally:
        server.stop()
