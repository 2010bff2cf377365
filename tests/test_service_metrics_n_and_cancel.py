"""Telemetry of requests with n samples and of requests cut short, on a live server: the tokens of every
sample count, finished or not; inter-token latency is measured within each sample; a request its caller
cancels, or whose gRPC deadline passes, is observed in the e2e latency and its span has a `finished`
event and the call's status."""

from __future__ import annotations

import grpc
import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from service_harness import UNENDING, MetricSamples, ServerThread, long_engine_config, wait_for

from sluice import Client, SluiceError, generate_request
from sluice.engine.outputs import RequestOutput, Timings, Usage
from sluice.service.generation import RequestProgress
from sluice.service.server import ServerConfig

pytestmark = pytest.mark.timeout(120)

ABORTS = ("sluice_requests_total", (("finish_reason", "abort"), ("tenant", "default")))
GENERATED = ("sluice_generation_tokens_total", (("tenant", "default"),))
PROMPTS = ("sluice_prompt_tokens_total", (("tenant", "default"),))
E2E_COUNT = ("sluice_e2e_request_latency_seconds_count", ())
ITL_COUNT = ("sluice_inter_token_latency_seconds_count", ())


@pytest.fixture(scope="module")
def observed(llama_long_dir: str):
    """A server whose spans go to memory; its long-context model lets a request run until the test ends it."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0)
    thread = ServerThread(long_engine_config(llama_long_dir), config, tracer_provider=provider).start()
    thread.memory = memory
    yield thread
    thread.stop()
    provider.shutdown()


def _delta(
    before: MetricSamples, after: MetricSamples, key: tuple[str, tuple[tuple[str, str], ...]]
) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _wait_for_the_abort(server: ServerThread, before: MetricSamples, num_samples: int = 1):
    """The request's span, once its samples' aborts are counted and its span ended (when the handler
    unwinds, which may come after the engine reports idle)."""
    server.wait_idle()
    wait_for(lambda: _delta(before, server.metric_samples(), ABORTS) == num_samples, "the abort count")
    wait_for(lambda: len(server.memory.get_finished_spans()) == 1, "the request's span")
    (span,) = server.memory.get_finished_spans()
    return span


def test_a_cancelled_request_counts_the_tokens_of_all_its_samples(observed: ServerThread) -> None:
    """n = 2, cancelled while both samples run: what they generated counts (no sample finished)."""
    observed.memory.clear()
    before, generated_before = observed.metric_samples(), observed.stats().num_generation_tokens
    received = {0: 0, 1: 0}
    with Client(observed.target) as client:
        chunks = client.generate(generate_request("Hello world", n=2, **UNENDING))
        for chunk in chunks:
            received[chunk.index] += len(chunk.token_ids)
            if min(received.values()) > 0:
                break
        chunks.close()  # cancels the call
    span = _wait_for_the_abort(observed, before, num_samples=2)
    counted = _delta(before, observed.metric_samples(), GENERATED)
    assert dict(span.attributes)["gen_ai.usage.output_tokens"] == counted
    assert dict(span.attributes)["gen_ai.response.finish_reasons"] == ("abort", "abort")
    assert dict(span.attributes)["gen_ai.request.choice.count"] == 2
    # The server streamed at least what the client read, and no more than the engine sampled.
    assert sum(received.values()) <= counted <= observed.stats().num_generation_tokens - generated_before


def test_progress_sums_the_latest_usage_of_every_sample() -> None:
    """The final output of a request whose caller left: "abort", finished now, with both samples' tokens
    and preemptions to date."""
    progress = RequestProgress("r", num_samples=2)
    timings = Timings(arrival=100.0, first_scheduled=100.5, first_token=101.0, finished=None)
    for index, num_tokens, num_preemptions in ((0, 3, 0), (1, 2, 1), (0, 5, 1), (1, 7, 2)):
        usage = Usage(prompt_tokens=4, completion_tokens=num_tokens, cached_tokens=0)
        output = RequestOutput("r", (1,), "a", usage=usage, timings=timings, num_preemptions=num_preemptions)
        progress.add(msgspec.structs.replace(output, index=index))
    final = progress.final_output(caller_left=True)
    assert (final.finish_reason, final.usage.completion_tokens, final.num_preemptions) == ("abort", 12, 3)
    assert final.usage.prompt_tokens == 4 and final.token_ids == ()
    assert final.timings.arrival == 100.0 and final.timings.finished >= 101.0
    assert progress.final_output(caller_left=False) is None  # refused or failed: no sample finished


def test_the_token_counters_move_while_a_request_runs(observed: ServerThread) -> None:
    """As vLLM's, every chunk's tokens count when it is sent: a request longer than a dashboard's rate
    window shows as throughput while it runs, not as a spike when it ends."""
    observed.memory.clear()
    before = observed.metric_samples()
    with Client(observed.target) as client:
        chunks = client.generate(generate_request("Hello world", **UNENDING))
        received = 0
        for chunk in chunks:
            received += len(chunk.token_ids)
            if received >= 3:
                break
        running = observed.metric_samples()
        chunks.close()
    assert _delta(before, running, GENERATED) >= received
    assert _delta(before, running, PROMPTS) > 0
    assert _delta(before, running, ABORTS) == 0  # still running when read
    _wait_for_the_abort(observed, before)


def test_progress_keeps_every_samples_finish_reason_and_the_first_token() -> None:
    """n = 2: each sample's own reason (the span's finish_reasons, one count each), and the request's
    first token is the first sample's, not the last finished one's."""
    progress = RequestProgress("r", num_samples=2)
    usage = Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=0)
    for index, reason, first_token, finished in ((1, "length", 101.0, 104.0), (0, "stop", 102.5, 105.0)):
        timings = Timings(arrival=100.0, first_scheduled=100.5, first_token=first_token, finished=finished)
        output = RequestOutput("r", (1,), "a", finish_reason=reason, usage=usage, timings=timings)
        progress.add(msgspec.structs.replace(output, index=index))
    final = progress.final_output(caller_left=False)
    assert progress.finish_reasons(final) == ("stop", "length")
    assert (final.timings.first_token, final.timings.finished) == (101.0, 105.0)
    assert final.usage.completion_tokens == 6


def test_inter_token_latency_is_measured_within_each_sample(observed: ServerThread) -> None:
    """Each sample's tokens after its own first chunk get a gap; another sample's chunk in between does
    not end one (it decodes side by side)."""
    before = observed.metric_samples()
    with Client(observed.target) as client:
        request = generate_request("Hello world", n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
        chunks = [chunk for chunk in client.generate(request) if chunk.token_ids]
    observed.wait_idle()
    num_later_tokens = 0
    for index in (0, 1):
        sample = [chunk for chunk in chunks if chunk.index == index]
        assert sum(len(chunk.token_ids) for chunk in sample) == 8
        num_later_tokens += sum(len(chunk.token_ids) for chunk in sample[1:])
    assert _delta(before, observed.metric_samples(), ITL_COUNT) == num_later_tokens


def _events(span) -> list[str]:
    stamps = [event.timestamp for event in span.events]
    assert stamps == sorted(stamps)
    return [event.name for event in span.events]


def test_a_request_the_caller_cancels_is_observed_in_the_e2e_latency(observed: ServerThread) -> None:
    observed.memory.clear()
    before = observed.metric_samples()
    with Client(observed.target) as client:
        chunks = client.generate(generate_request("Hello world", **UNENDING))
        assert next(chunks).token_ids
        chunks.close()  # cancels the call
    span = _wait_for_the_abort(observed, before)
    assert _delta(before, observed.metric_samples(), E2E_COUNT) == 1
    assert _events(span) == ["queued", "scheduled", "first_token", "finished"]
    assert dict(span.events[-1].attributes) == {"finish_reason": "abort"}
    assert span.status.status_code == StatusCode.UNSET  # the caller left: not a failure
    assert dict(span.attributes)["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert "error.type" not in dict(span.attributes)


def test_a_request_past_its_grpc_deadline_is_observed_and_is_an_error(
    observed: ServerThread,
) -> None:
    """OTel's gRPC server conventions: DEADLINE_EXCEEDED is an error; the request is an abort."""
    observed.memory.clear()
    before = observed.metric_samples()
    with Client(observed.target) as client:
        chunks = client.generate(generate_request("Hello world", **UNENDING), timeout=5.0)
        with pytest.raises(SluiceError) as info:
            for _ in chunks:
                pass
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    span = _wait_for_the_abort(observed, before)
    assert _delta(before, observed.metric_samples(), E2E_COUNT) == 1
    assert _events(span)[-1] == "finished"
    assert span.status.status_code == StatusCode.ERROR
    attributes = dict(span.attributes)
    assert attributes["error.type"] == "DEADLINE_EXCEEDED"
    assert attributes["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert attributes["gen_ai.response.finish_reasons"] == ("abort",)
