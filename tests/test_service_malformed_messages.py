"""Request messages that do not parse as their type (invalid UTF-8 in a string field, a truncated message,
garbage bytes), sent as raw bytes: INVALID_ARGUMENT naming the type and the parser's reason, on every
service of the port, with no server fault logged; a StreamGenerate message answered in-band while the
stream's other requests go on. (grpc ran the generated FromString before any Sluice code: UNKNOWN
"Unexpected <class 'DecodeError'>" with a traceback, and StreamGenerate ended INTERNAL with its
requests.)"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from service_harness import UNENDING, ServerThread, status_code, wait_for

from sluice import generate_request
from sluice.service.server import ServerConfig
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(180)  # a hang's bound: one wait alone may take PATIENCE_S (60 s)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_UTF8 = "String field had bad UTF-8"
CORRUPT = "Wire format was corrupt"
GARBAGE = b"\xff\xff\xff\xff\xff"  # a field number past the largest, an unfinished varint


def _field(number: int, data: bytes) -> bytes:
    """A length-delimited field (string, bytes, message) of a small number and length, on the wire."""
    assert number < 16 and len(data) < 128
    return bytes([number << 3 | 2, len(data)]) + data


def _raw(data: bytes) -> bytes:
    return data


def _message(type_name: str, reason: str) -> str:
    return f"the request message ({type_name}) did not parse: {reason}"


def _rpc_count(server: ServerThread, method: str, code: str) -> float:
    labels = {"method": method, "code": code}
    return server.server.metrics.registry.get_sample_value("sluice_rpc_requests_total", labels) or 0.0


def _server_faults(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]


# (case, method, response streaming, raw request, the type it did not parse as, the parser's reason,
# the method's sluice_rpc_requests_total label or None where calls are not counted)
UNARY_REQUESTS = [
    (
        "Generate text of bad UTF-8",
        "/sluice.v1.InferenceService/Generate",
        True,
        _field(2, b"Hi \xff\xfe there"),
        "sluice.v1.GenerateRequest",
        BAD_UTF8,
        "Generate",
    ),
    (
        "Generate request_id of bad UTF-8",
        "/sluice.v1.InferenceService/Generate",
        True,
        _field(1, b"\xc3\x28") + _field(2, b"Hi"),
        "sluice.v1.GenerateRequest",
        BAD_UTF8,
        "Generate",
    ),
    (
        "Generate truncated",
        "/sluice.v1.InferenceService/Generate",
        True,
        generate_request("Hello", max_tokens=2).SerializeToString()[:-1],
        "sluice.v1.GenerateRequest",
        CORRUPT,
        "Generate",
    ),
    (
        "Tokenize text of bad UTF-8",
        "/sluice.v1.InferenceService/Tokenize",
        False,
        _field(1, b"\xff\xfe"),
        "sluice.v1.TokenizeRequest",
        BAD_UTF8,
        "Tokenize",
    ),
    (
        "GetModelInfo garbage",
        "/sluice.v1.InferenceService/GetModelInfo",
        False,
        GARBAGE,
        "sluice.v1.GetModelInfoRequest",
        CORRUPT,
        "GetModelInfo",
    ),
    (
        "VllmEngine Generate text of bad UTF-8",
        "/vllm.grpc.engine.VllmEngine/Generate",
        True,
        _field(1, b"r") + _field(3, b"\xff"),
        "vllm.grpc.engine.GenerateRequest",
        BAD_UTF8,
        "VllmEngine.Generate",
    ),
    (
        "VllmEngine HealthCheck garbage",
        "/vllm.grpc.engine.VllmEngine/HealthCheck",
        False,
        GARBAGE,
        "vllm.grpc.engine.HealthCheckRequest",
        CORRUPT,
        "VllmEngine.HealthCheck",
    ),
    (
        "Health Check service of bad UTF-8",
        "/grpc.health.v1.Health/Check",
        False,
        _field(1, b"\xff"),
        "grpc.health.v1.HealthCheckRequest",
        BAD_UTF8,
        None,
    ),
    (  # a behaviour that writes its own responses (a coroutine, not an async generator)
        "Health Watch service of bad UTF-8",
        "/grpc.health.v1.Health/Watch",
        True,
        _field(1, b"\xff"),
        "grpc.health.v1.HealthCheckRequest",
        BAD_UTF8,
        None,
    ),
]


@pytest.mark.parametrize(
    ("case", "method", "streaming", "request_", "type_name", "reason", "counted_as"),
    UNARY_REQUESTS,
    ids=[c[0] for c in UNARY_REQUESTS],
)
def test_a_unary_request_that_does_not_parse_is_invalid_argument_naming_its_type(
    stub, server, caplog, case, method, streaming, request_, type_name, reason, counted_as
) -> None:
    before = counted_as and _rpc_count(server, counted_as, "INVALID_ARGUMENT")
    channel = server.channel()
    make = channel.unary_stream if streaming else channel.unary_unary
    call = make(method, request_serializer=_raw, response_deserializer=_raw)
    with pytest.raises(grpc.RpcError) as info:
        response = call(request_, timeout=30)
        if streaming:
            list(response)
    channel.close()
    assert (info.value.code(), info.value.details()) == (INVALID, _message(type_name, reason))
    if counted_as is not None:
        assert _rpc_count(server, counted_as, "INVALID_ARGUMENT") == before + 1
    assert _server_faults(caplog) == []
    # The server goes on serving.
    chunks = list(stub.Generate(generate_request("Hello", max_tokens=2, ignore_eos=True)))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    server.wait_idle()


class RawOutbox:
    """A raw-bytes request iterator for a bidi call that the test feeds while reading responses."""

    def __init__(self) -> None:
        self._queue: queue.Queue[bytes | None] = queue.Queue()

    def send(self, data: bytes) -> None:
        self._queue.put(data)

    def generate(self, request: pb.GenerateRequest) -> None:
        self.send(pb.StreamGenerateRequest(generate=request).SerializeToString())

    def cancel(self, request_id: str) -> None:
        cancel = pb.StreamCancel(request_id=request_id)
        self.send(pb.StreamGenerateRequest(cancel=cancel).SerializeToString())

    def half_close(self) -> None:
        self._queue.put(None)

    def __iter__(self) -> Iterator[bytes]:
        while (data := self._queue.get()) is not None:
            yield data


def _next_where(
    responses: Iterator[pb.StreamGenerateResponse], condition: Callable[[pb.StreamGenerateResponse], bool]
) -> pb.StreamGenerateResponse:
    return next(response for response in responses if condition(response))


def _last_chunk_of(request_id: str) -> Callable[[pb.StreamGenerateResponse], bool]:
    return lambda r: r.request_id == request_id and r.chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED


def test_a_stream_message_that_does_not_parse_is_refused_in_band_and_the_stream_goes_on(
    server, caplog
) -> None:
    """The message names no request it could be answered under (its request_id may be the bad field):
    its error goes out under request_id "", as that of a message without an action; a request already
    running goes on, a later one runs, and every request ends with its last chunk."""
    before = _rpc_count(server, "StreamGenerate.request", "INVALID_ARGUMENT")
    channel = server.channel()
    stream_generate = channel.stream_stream(
        "/sluice.v1.InferenceService/StreamGenerate",
        request_serializer=_raw,
        response_deserializer=pb.StreamGenerateResponse.FromString,
    )
    outbox = RawOutbox()
    responses = stream_generate(iter(outbox), timeout=50)
    outbox.generate(generate_request("Hello world", request_id="long", **UNENDING))
    assert next(responses).request_id == "long"
    outbox.send(_field(1, _field(1, b"\xff")))  # generate { request_id: "\xff" }
    refused = _next_where(responses, lambda r: r.WhichOneof("event") == "error")
    error = (refused.request_id, status_code(refused.error.code), refused.error.message)
    assert error == ("", INVALID, _message("sluice.v1.StreamGenerateRequest", BAD_UTF8))
    assert server.stats().num_running == 1
    outbox.generate(generate_request("Hi", request_id="short", max_tokens=2, ignore_eos=True))
    assert _next_where(responses, _last_chunk_of("short")).chunk.finish_reason == pb.FINISH_REASON_LENGTH
    outbox.cancel("long")
    last = _next_where(responses, _last_chunk_of("long"))
    assert last.chunk.finish_reason == pb.FINISH_REASON_ABORT
    outbox.half_close()
    assert list(responses) == []  # the call ends OK
    channel.close()
    server.wait_idle()
    wait_for(lambda: server.server.num_active_requests == 0, "no live request on the server")
    assert _rpc_count(server, "StreamGenerate.request", "INVALID_ARGUMENT") == before + 1
    assert _server_faults(caplog) == []


@pytest.mark.parametrize(
    "service", ["grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"]
)
def test_a_reflection_message_that_does_not_parse_ends_the_call_invalid_argument(
    server, caplog, service
) -> None:
    channel = server.channel()
    reflect = channel.stream_stream(
        f"/{service}/ServerReflectionInfo",
        request_serializer=_raw,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    list_services = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        list(reflect(iter([list_services, _field(1, b"\xff"), list_services]), timeout=30))
    message = _message("grpc.reflection.v1alpha.ServerReflectionRequest", BAD_UTF8)
    assert (info.value.code(), info.value.details()) == (INVALID, message)
    (answer,) = reflect(iter([list_services]), timeout=30)  # the server goes on answering
    assert "sluice.v1.InferenceService" in [s.name for s in answer.list_services_response.service]
    channel.close()
    assert _server_faults(caplog) == []


def test_a_malformed_call_without_its_api_key_is_refused_for_the_key(caplog) -> None:
    """The API key is checked first: the message of a call refused for its key is never looked at.
    Health needs no key: its malformed Check is refused for the message."""
    thread = ServerThread(
        engine_config=None, server_config=ServerConfig(host="127.0.0.1", port=0, api_key="k")
    )
    thread.start(attach=False)
    try:
        channel = thread.channel()
        tokenize = channel.unary_unary(
            "/sluice.v1.InferenceService/Tokenize", request_serializer=_raw, response_deserializer=_raw
        )
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=_raw,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        calls = [
            (tokenize, ()),
            (tokenize, (("authorization", "Bearer k"),)),
            (check, ()),
        ]
        statuses = []
        for call, metadata in calls:
            with pytest.raises(grpc.RpcError) as info:
                call(_field(1, b"\xff"), metadata=metadata, timeout=30)
            statuses.append((info.value.code(), info.value.details()))
        channel.close()
    finally:
        thread.stop()
    missing = "authorization: missing; send 'authorization: Bearer <api key>' metadata"
    assert statuses == [
        (grpc.StatusCode.UNAUTHENTICATED, missing),
        (INVALID, _message("sluice.v1.TokenizeRequest", BAD_UTF8)),
        (INVALID, _message("grpc.health.v1.HealthCheckRequest", BAD_UTF8)),
    ]
    assert _server_faults(caplog) == []
