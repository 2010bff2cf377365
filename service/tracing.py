"""OpenTelemetry: one SERVER span per generation request, continuing the caller's W3C traceparent
(the request's own `trace_context`, else the call's metadata).

The tracer provider is passed in explicitly (never the global one). `tracer_provider_from_env`
builds an OTLP/gRPC exporting provider when the standard OTEL_* variables ask for one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import SamplingParams

_PROPAGATOR = TraceContextTextMapPropagator()


def tracer_provider_from_env(environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """An OTLP/gRPC exporting provider if OTEL_TRACES_EXPORTER is "otlp" or an OTLP endpoint is set;
    None (tracing off) otherwise or when OTEL_TRACES_EXPORTER is "none". The exporter itself reads
    OTEL_EXPORTER_OTLP_* (endpoint, headers, insecure, timeout) from the environment."""
    env = os.environ if environ is None else environ
    exporter_name = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint_set = bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    if exporter_name == "none" or not (exporter_name == "otlp" or endpoint_set):
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME", "sluice")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """Starts and ends the span of each generation request."""

    def __init__(self, provider: trace.TracerProvider | None, model_name: str) -> None:
        provider = provider if provider is not None else trace.NoOpTracerProvider()
        self._tracer = provider.get_tracer("sluice.service")
        self._model_name = model_name

    def start(
        self,
        metadata: Sequence[tuple[str, str | bytes]],
        operation: str,
        params: SamplingParams,
        trace_context: Mapping[str, str] | None = None,
    ) -> Span:
        """A SERVER span whose parent is the request's own `trace_context` (traceparent, tracestate)
        when given, else the traceparent in the call's metadata (if any)."""
        if trace_context:
            carrier = {key.lower(): value for key, value in trace_context.items()}
        else:
            carrier = {key: value for key, value in metadata if isinstance(value, str)}
        parent = _PROPAGATOR.extract(carrier=carrier)
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.system": "sluice",
            "gen_ai.request.model": self._model_name,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "rpc.system": "grpc",
            "rpc.service": "sluice.v1.InferenceService",
        }
        if params.top_k:
            attributes["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        name = f"{operation} {self._model_name}"
        return self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)

    @staticmethod
    def finish(span: Span, final: RequestOutput | None, error: BaseException | None = None) -> None:
        """Records usage, finish reason and the request's life events, then ends the span."""
        if final is not None:
            _record_final(span, final)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
            span.set_attribute("error.type", type(error).__name__)
        span.end()


def _record_final(span: Span, final: RequestOutput) -> None:
    span.set_attribute("gen_ai.response.finish_reasons", (final.finish_reason,))
    if final.usage is not None:
        span.set_attribute("gen_ai.usage.input_tokens", final.usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", final.usage.completion_tokens)
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", final.usage.cached_tokens)
    timings = final.timings
    if timings is None:
        return
    span.add_event("queued", timestamp=_ns(timings.arrival))
    if timings.first_scheduled is not None:
        span.add_event("scheduled", timestamp=_ns(timings.first_scheduled))
    if timings.first_token is not None:
        span.add_event("first_token", timestamp=_ns(timings.first_token))
    if final.num_preemptions > 0:
        span.add_event("preempted", {"sluice.num_preemptions": final.num_preemptions})
    if timings.finished is not None:
        span.add_event("finished", {"finish_reason": final.finish_reason}, timestamp=_ns(timings.finished))
    if final.finish_reason == "error":
        span.set_status(Status(StatusCode.ERROR, final.error or "engine error"))
