"""Telemetry of a live server: one span per request continuing the caller's trace (in memory and over
real OTLP/gRPC to a receiver started here), and a /metrics scrape whose counts match the requests made."""

from __future__ import annotations

import threading
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from service_harness import UNENDING, ServerThread, long_engine_config, wait_for

from sluice import Client, SluiceError, generate_request
from sluice.service.server import ServerConfig
from sluice.service.tracing import tracer_provider_from_env
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(180)  # a hang's bound: one wait alone may take PATIENCE_S (60 s)

TRACE_IDS = ("0af7651916cd43dd8448eb211c80319c", "4bf92f3577b34da6a3ce929d0e0e4736")
PARENT_SPAN_ID = "b7ad6b7169203331"


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace collector that keeps what it receives."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.received = threading.Event()

    def Export(self, request, context):
        self.requests.append(request)
        self.received.set()
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list:
        return [
            s for r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans
        ]


@pytest.fixture(scope="module")
def receiver():
    servicer = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.port = port
    yield servicer
    server.stop(0)


@pytest.fixture(scope="module")
def observed(llama_long_dir: str, receiver: OtlpReceiver):
    """A server whose provider exports over OTLP (configured by OTEL_* variables) and into memory; its
    long-context model lets a request run until the test ends it."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
        env.setenv("OTEL_SERVICE_NAME", "sluice-test")
        provider = tracer_provider_from_env()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0)
    thread = ServerThread(long_engine_config(llama_long_dir), config, tracer_provider=provider).start()
    thread.memory, thread.provider = memory, provider
    yield thread
    thread.stop()
    provider.shutdown()


def _traceparent(trace_id: str) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{trace_id}-{PARENT_SPAN_ID}-01"),)


def test_one_span_per_request_continuing_the_callers_trace(observed: ServerThread) -> None:
    observed.memory.clear()
    request = generate_request("Hello world", temperature=0.0, top_p=0.5, max_tokens=5, ignore_eos=True)
    with Client(observed.target) as client:
        completion = client.complete(request, metadata=_traceparent(TRACE_IDS[0]))
        stream_request = pb.StreamGenerateRequest(
            generate=generate_request(
                messages=[{"role": "user", "content": "hi"}], request_id="s", max_tokens=3, ignore_eos=True
            )
        )
        list(client.stream_generate([stream_request], metadata=_traceparent(TRACE_IDS[1])))
    spans = sorted(observed.memory.get_finished_spans(), key=lambda s: s.name)
    assert [s.name for s in spans] == [
        f"chat {completion_model(observed)}",
        f"text_completion {completion_model(observed)}",
    ]
    chat, text = spans
    assert {format(s.context.trace_id, "032x") for s in (text, chat)} == set(TRACE_IDS)
    assert format(text.context.trace_id, "032x") == TRACE_IDS[0]
    assert format(text.parent.span_id, "016x") == PARENT_SPAN_ID and text.kind == SpanKind.SERVER
    attrs = dict(text.attributes)
    assert attrs["gen_ai.request.model"] == completion_model(observed)
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"]) == (5, 0.0)
    assert attrs["gen_ai.request.top_p"] == 0.5
    assert attrs["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == completion.usage.cached_tokens
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    names = [e.name for e in text.events]
    assert names == ["queued", "scheduled", "first_token", "finished"]
    stamps = [e.timestamp for e in text.events]
    assert stamps == sorted(stamps)
    assert dict(chat.attributes)["gen_ai.usage.output_tokens"] == 3


def test_each_stream_request_continues_its_own_trace_context(observed: ServerThread) -> None:
    """Two requests on one StreamGenerate call, each with its own W3C trace_context: two spans, each a
    child of its request's traceparent (not of the call's metadata), tracestate kept."""
    observed.memory.clear()
    parents = {"a": ("1" * 32, "a1" * 8), "b": ("2" * 32, "b2" * 8)}

    def request(request_id: str) -> pb.StreamGenerateRequest:
        trace_id, span_id = parents[request_id]
        context = {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": f"vendor={request_id}"}
        return pb.StreamGenerateRequest(
            generate=generate_request("hi", request_id=request_id, max_tokens=2, trace_context=context)
        )

    with Client(observed.target) as client:
        metadata = _traceparent(TRACE_IDS[0])  # overridden by each request's own context
        list(client.stream_generate([request("a"), request("b")], metadata=metadata))
    spans = observed.memory.get_finished_spans()
    got = {
        (
            format(s.context.trace_id, "032x"),
            format(s.parent.span_id, "016x"),
            s.parent.trace_state.get("vendor"),
        )
        for s in spans
    }
    assert got == {("1" * 32, "a1" * 8, "a"), ("2" * 32, "b2" * 8, "b")}


def completion_model(server: ServerThread) -> str:
    return server.engine.model_info.name


def test_spans_reach_an_otlp_receiver(observed: ServerThread, receiver: OtlpReceiver) -> None:
    trace_id = "1234567890abcdef1234567890abcdef"
    with Client(observed.target) as client:
        client.complete(
            generate_request("otlp", max_tokens=2, ignore_eos=True), metadata=_traceparent(trace_id)
        )
    assert observed.provider.force_flush(10_000)
    exported = [s for s in receiver.spans() if s.trace_id.hex() == trace_id]
    assert len(exported) == 1
    span = exported[0]
    assert span.parent_span_id.hex() == PARENT_SPAN_ID and span.kind == span.SPAN_KIND_SERVER
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 2
    resources = [r.resource for r in receiver.requests[-1].resource_spans]
    assert any(
        a.key == "service.name" and a.value.string_value == "sluice-test"
        for r in resources
        for a in r.attributes
    )


def _scrape(server: ServerThread) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(
        f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=5
    ) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_count_the_requests_made(observed: ServerThread) -> None:
    before = _scrape(observed)
    usages = []
    num_later_tokens = 0  # tokens after a request's first chunk: each gets an inter-token latency
    with Client(observed.target) as client:
        for prompt in ("one", "two two", "three three three"):
            chunks = list(client.generate(generate_request(prompt, max_tokens=4, ignore_eos=True)))
            usages.append(chunks[-1].usage)
            num_later_tokens += 4 - len(next(c for c in chunks if c.token_ids).token_ids)
        with pytest.raises(SluiceError):
            client.complete(generate_request("bad", top_p=0.0))
    observed.wait_idle()
    after = _scrape(observed)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("sluice_requests_total", finish_reason="length", tenant="default") == 3
    assert delta("sluice_rpc_requests_total", method="Generate", code="OK") == 3
    assert delta("sluice_rpc_requests_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert delta("sluice_generation_tokens_total", tenant="default") == 12
    assert delta("sluice_prompt_tokens_total", tenant="default") == sum(u.prompt_tokens for u in usages)
    assert delta("sluice_cached_tokens_total", tenant="default") == sum(u.cached_tokens for u in usages)
    assert delta("sluice_time_to_first_token_seconds_count") == 3
    assert delta("sluice_e2e_request_latency_seconds_count") == 3
    assert delta("sluice_queue_time_seconds_count") == 3
    # Tokens merged into the first chunk (a reader slower than the engine) have no gap to observe; how
    # many were merged depends on the machine's speed (test_inter_token_latency_... makes sure of some).
    assert delta("sluice_inter_token_latency_seconds_count") == num_later_tokens
    assert num_later_tokens <= 9
    assert after[("sluice_num_requests_running", ())] == 0
    assert after[("sluice_num_requests_waiting", ())] == 0
    assert after[("sluice_kv_cache_usage_ratio", ())] == 0
    assert ("sluice_preemptions_total", ()) in after
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    assert delta("sluice_prefix_cache_queries_total") == prompt_tokens
    assert delta("sluice_prefix_cache_hits_total") == sum(u.cached_tokens for u in usages)


def test_inter_token_latency_counts_every_token_after_the_first_chunk(observed: ServerThread) -> None:
    """A request that runs until the test aborts it streams a second chunk, however fast the machine."""
    before = _scrape(observed)
    with Client(observed.target) as client:
        chunks = client.generate(generate_request("Hello world", request_id="itl", **UNENDING))
        received = [next(chunks), next(chunks)]
        client.abort("itl")
        received += list(chunks)
    observed.wait_idle()
    after = _scrape(observed)
    key = ("sluice_inter_token_latency_seconds_count", ())
    later_tokens = sum(len(c.token_ids) for c in received[1:])
    assert after[key] - before.get(key, 0.0) == later_tokens > 0
    assert received[-1].finish_reason == pb.FINISH_REASON_ABORT


def test_a_request_the_caller_cancels_counts_as_aborted_not_failed(observed: ServerThread) -> None:
    observed.memory.clear()
    before = _scrape(observed)
    with Client(observed.target) as client:
        chunks = client.generate(generate_request("Hello world", **UNENDING))  # runs until cancelled
        assert next(chunks).token_ids
        chunks.close()  # leaving the stream cancels the call
    observed.wait_idle()
    key = ("sluice_requests_total", (("finish_reason", "abort"), ("tenant", "default")))
    # Counted and the span ended when the handler unwinds, which may come after the engine reports idle.
    wait_for(lambda: _scrape(observed).get(key, 0.0) - before.get(key, 0.0) == 1, "the abort count")
    wait_for(lambda: bool(observed.memory.get_finished_spans()), "the request's span")
    (span,) = observed.memory.get_finished_spans()
    assert dict(span.attributes)["gen_ai.response.finish_reasons"] == ("abort",)
    assert span.status.status_code.name == "UNSET"
