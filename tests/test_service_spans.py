"""The span of each generation request on a live server with tenants: the gRPC service and method it came
through (sluice.v1 or SMG's vllm.grpc.engine) and its final status code, per OTel's RPC conventions; one
ERROR span for every request refused on its way (a bad field on either API, a tenant over its limit, a
prompt too long); and preemptions as an attribute, not an event stamped at the span's end."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from service_harness import UNENDING, ServerThread, long_engine_config, wait_for
from smg_grpc_proto import vllm_engine_pb2 as smg
from smg_grpc_proto import vllm_engine_pb2_grpc as smg_grpc

from sluice import Client, SluiceError, generate_request
from sluice.engine.outputs import RequestOutput, Timings, Usage
from sluice.engine.sampling_params import SamplingParams
from sluice.service.caller import Call
from sluice.service.server import ServerConfig
from sluice.service.tenants import TenantDirectory
from sluice.service.tracing import RequestTracer
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(120)

KEYS_TOML = """
[[tenant]]
name = "open"
keys = ["key-open"]

[[tenant]]
name = "small"
keys = ["key-small"]
max_concurrent_requests = 1
"""
OPEN = (("authorization", "Bearer key-open"),)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
SLUICE = "sluice.v1.InferenceService"
SMG = "vllm.grpc.engine.VllmEngine"


@pytest.fixture(scope="module")
def observed(llama_long_dir: str, tmp_path_factory: pytest.TempPathFactory):
    keys = Path(tmp_path_factory.mktemp("keys")) / "api-keys.toml"
    keys.write_text(KEYS_TOML)
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    config = ServerConfig(host="127.0.0.1", port=0, tenants=TenantDirectory.load(keys))
    thread = ServerThread(long_engine_config(llama_long_dir), config, tracer_provider=provider).start()
    thread.memory = memory
    yield thread
    thread.stop()
    provider.shutdown()


def _smg_request(request_id: str, **sampling: object) -> smg.GenerateRequest:
    return smg.GenerateRequest(
        request_id=request_id,
        tokenized=smg.TokenizedInput(input_ids=list(range(20, 30))),
        sampling_params=smg.SamplingParams(**sampling),
        stream=True,
    )


def _rpc(span) -> tuple[str, str, int]:
    attributes = dict(span.attributes)
    return attributes["rpc.service"], attributes["rpc.method"], attributes["rpc.grpc.status_code"]


def _wait_for_spans(server: ServerThread, count: int) -> list:
    """The spans ended so far, once there are `count` (a span ends as its handler unwinds)."""
    wait_for(lambda: len(server.memory.get_finished_spans()) >= count, f"{count} spans")
    spans = server.memory.get_finished_spans()
    assert len(spans) == count
    return list(spans)


def test_each_span_names_the_service_and_method_its_request_came_through(observed: ServerThread) -> None:
    observed.memory.clear()
    request = generate_request("Hello", request_id="g", max_tokens=2, ignore_eos=True)
    with Client(observed.target, api_key="key-open") as client:
        client.complete(request)
        list(client.stream_generate([pb.StreamGenerateRequest(generate=request)]))
    with observed.channel() as channel:
        list(smg_grpc.VllmEngineStub(channel).Generate(_smg_request("m", max_tokens=2), metadata=OPEN))
    spans = _wait_for_spans(observed, 3)
    ok = grpc.StatusCode.OK.value[0]
    assert sorted(_rpc(span) for span in spans) == [
        (SLUICE, "Generate", ok),
        (SLUICE, "StreamGenerate", ok),
        (SMG, "Generate", ok),
    ]
    assert all(span.status.status_code == StatusCode.UNSET for span in spans)
    assert [dict(span.attributes)["gen_ai.usage.output_tokens"] for span in spans] == [2, 2, 2]


def _refused(span) -> tuple[str, str, int, str]:
    assert span.status.status_code == StatusCode.ERROR
    return (*_rpc(span), dict(span.attributes)["error.type"])


def test_every_refused_request_has_one_error_span(observed: ServerThread) -> None:
    """Refused in conversion (top_p 0 on sluice.v1, 2 on SMG), by the tenant's limit, or by the engine (a
    prompt and max_tokens past the context): one span each, its status the call's."""
    observed.memory.clear()
    with Client(observed.target, api_key="key-open") as client:
        with pytest.raises(SluiceError) as invalid:
            client.complete(generate_request("bad", top_p=0.0))
        with pytest.raises(SluiceError) as too_long:
            client.complete(generate_request("bad", max_tokens=200_000))
    with observed.channel() as channel, pytest.raises(grpc.RpcError) as smg_invalid:
        list(smg_grpc.VllmEngineStub(channel).Generate(_smg_request("s", top_p=2.0), metadata=OPEN))
    with Client(observed.target, api_key="key-small") as client:
        running = client.generate(generate_request("Hello", **UNENDING))
        assert next(running).token_ids
        with pytest.raises(SluiceError) as over_limit:
            client.complete(generate_request("Hello", max_tokens=2))
        running.close()
    codes = (invalid.value.code, too_long.value.code, smg_invalid.value.code(), over_limit.value.code)
    invalid_argument, exhausted = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
    assert codes == (invalid_argument, exhausted, invalid_argument, exhausted)
    spans = _wait_for_spans(observed, 5)
    cancelled = next(span for span in spans if "error.type" not in dict(span.attributes))
    assert _rpc(cancelled) == (SLUICE, "Generate", grpc.StatusCode.CANCELLED.value[0])
    spans.remove(cancelled)
    assert sorted(_refused(span) for span in spans) == [
        (SLUICE, "Generate", invalid_argument.value[0], "ValueError"),  # SamplingParams' check
        (SLUICE, "Generate", exhausted.value[0], "ContextLengthError"),
        (SLUICE, "Generate", exhausted.value[0], "TenantOverLimitError"),
        (SMG, "Generate", invalid_argument.value[0], "InvalidRequestError"),
    ]


def test_a_span_continues_the_traceparent_and_records_the_request() -> None:
    """The engine keeps no time of a preemption: the count is an attribute (no event stamped at the span's
    end, after `finished`), every event is stamped when it happened."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"),)
    call = Call(metadata, rpc_service=SLUICE, rpc_method="Generate")
    with RequestTracer(provider, "tiny-llama").start(call, "text_completion") as span:
        span.record_params(SamplingParams(temperature=0.5, top_p=0.9, max_tokens=8, seed=7))
        span.record_final(
            RequestOutput(
                "r",
                (),
                "",
                finish_reason="length",
                usage=Usage(prompt_tokens=5, completion_tokens=4, cached_tokens=2),
                timings=Timings(arrival=100.0, first_scheduled=100.5, first_token=101.0, finished=103.0),
                num_preemptions=2,
            ),
            ("length",),
        )
    (finished,) = memory.get_finished_spans()
    assert finished.name == "text_completion tiny-llama" and finished.kind == SpanKind.SERVER
    assert format(finished.context.trace_id, "032x") == TRACE_ID
    assert format(finished.parent.span_id, "016x") == PARENT_SPAN_ID
    assert dict(finished.attributes) == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.system": "sluice",
        "gen_ai.request.model": "tiny-llama",
        "gen_ai.request.max_tokens": 8,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.seed": 7,
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.usage.output_tokens": 4,
        "gen_ai.usage.cache_read.input_tokens": 2,
        "sluice.num_preemptions": 2,
        "rpc.system": "grpc",
        "rpc.service": SLUICE,
        "rpc.method": "Generate",
        "rpc.grpc.status_code": grpc.StatusCode.OK.value[0],
    }
    events = [(event.name, event.timestamp) for event in finished.events]
    assert events == [
        ("queued", 100_000_000_000),
        ("scheduled", 100_500_000_000),
        ("first_token", 101_000_000_000),
        ("finished", 103_000_000_000),
    ]
    assert finished.status.status_code == StatusCode.UNSET
