"""OpenTelemetry: one SERVER span per generation request, continuing the caller's W3C traceparent
(the request's own `trace_context`, else the call's metadata), following OTel's gen_ai and RPC (gRPC
server) conventions. A call refused before its request's span could start (unknown API key, the server
loading or draining, the request id in use) gets one too (`RequestTracer.refusals`): every generation
RPC leaves one span per request, or one for the call when it is refused before any request is read.

The tracer provider is passed in explicitly (never the global one). `tracer_provider_from_env`
builds an OTLP/gRPC exporting provider when the standard OTEL_* variables ask for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType

import grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.service.caller import Call
from sluice.service.status import CallDeadline, cancelled_status, status_for

_PROPAGATOR = TraceContextTextMapPropagator()


def tracer_provider_from_env(environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """An OTLP/gRPC exporting provider if OTEL_TRACES_EXPORTER lists "otlp" or an OTLP endpoint is set;
    None (tracing off) otherwise, when OTEL_TRACES_EXPORTER is "none" or OTEL_SDK_DISABLED is "true";
    an exporter other than those two is refused (ValueError naming the variable).
    The exporter itself reads OTEL_EXPORTER_OTLP_* (endpoint, headers, insecure, timeout) from the
    environment; a protocol other than grpc is refused (ValueError naming the variable: spans sent
    over the wrong one were lost). The resource takes OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME;
    service.name is "sluice" where neither sets it."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None  # the SDK off: no other OTEL_* variable is read (the spec's no-op SDK)
    # A comma-separated list in the spec ("otlp,console"); only otlp and none are served here.
    exporters = {name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "").split(",")} - {""}
    if unsupported := sorted(exporters - {"otlp", "none"}):
        raise ValueError(
            f"OTEL_TRACES_EXPORTER: {', '.join(map(repr, unsupported))} not supported; Sluice exports "
            "traces over OTLP (otlp) or not at all (none)"
        )
    endpoint_set = bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    if exporters == {"none"} or not ("otlp" in exporters or endpoint_set):
        return None
    # The traces' own variable wins over the general one, as in the SDK.
    variable = next(
        (v for v in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") if env.get(v)), None
    )
    if variable is not None and (protocol := env[variable].strip().lower()) != "grpc":
        raise ValueError(f"{variable}: {protocol!r} is not supported; Sluice exports over OTLP/gRPC (grpc)")
    _check_export_settings(env)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    resource = Resource.create(_resource_attributes(env))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


# The exporter's and the span processor's settings that the SDK reads with int() / float() (its errors name
# no variable: "could not convert string to float", "max_queue_size must be a positive integer") or checks
# with an exception other than ValueError (compression): each refused here naming its variable.
_EXPORT_SECONDS = ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
_EXPORT_COMPRESSIONS = ("OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION")
_COMPRESSIONS = ("gzip", "deflate", "none")
# The batch span processor's, with the SDK's defaults.
_BATCH_INTEGERS = {
    "OTEL_BSP_SCHEDULE_DELAY": 5000,
    "OTEL_BSP_EXPORT_TIMEOUT": 30000,
    "OTEL_BSP_MAX_QUEUE_SIZE": 2048,
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": 512,
}


def _check_export_settings(env: Mapping[str, str]) -> None:
    """ValueError naming the first OTEL_* export setting the SDK would fail on (or, for the span
    processor's integers, log a traceback for and ignore)."""
    for variable in _EXPORT_SECONDS:
        if (text := env.get(variable)) is not None:
            try:
                seconds = float(text)
            except ValueError:
                seconds = math.nan
            if not 0 < seconds < math.inf:
                raise ValueError(f"{variable}: must be a number of seconds > 0, got {text!r}")
    for variable in _EXPORT_COMPRESSIONS:
        if (text := env.get(variable)) is not None and text.strip().lower() not in _COMPRESSIONS:
            raise ValueError(f"{variable}: must be one of {', '.join(_COMPRESSIONS)}, got {text!r}")
    values = {}
    for variable, default in _BATCH_INTEGERS.items():
        text = env.get(variable)
        values[variable] = default if text is None else int(text) if text.strip().isdigit() else 0
        if values[variable] <= 0:
            raise ValueError(f"{variable}: must be an integer > 0, got {text!r}")
    if values["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] > values["OTEL_BSP_MAX_QUEUE_SIZE"]:
        raise ValueError("OTEL_BSP_MAX_EXPORT_BATCH_SIZE: must be <= OTEL_BSP_MAX_QUEUE_SIZE")


def _resource_attributes(env: Mapping[str, str]) -> dict[str, str]:
    """What `Resource.create` adds to what it reads from os.environ: OTEL_SERVICE_NAME from `env`, or
    "sluice" unless OTEL_RESOURCE_ATTRIBUTES names the service."""
    if name := env.get("OTEL_SERVICE_NAME"):
        return {SERVICE_NAME: name}
    attributes = env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    named = any(pair.split("=", 1)[0].strip() == SERVICE_NAME for pair in attributes.split(","))
    return {} if named else {SERVICE_NAME: "sluice"}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """Starts the span of each generation request, and of each call refused before its span started."""

    def __init__(self, provider: trace.TracerProvider | None, model_name: str | None) -> None:
        """`model_name` None: the model is still loading (spans then carry no gen_ai.request.model)."""
        provider = provider if provider is not None else trace.NoOpTracerProvider()
        self._tracer = provider.get_tracer("sluice.service")
        self._model_name = model_name

    def start(
        self,
        call: Call,
        operation: str | None,
        trace_context: Mapping[str, str] | None = None,
        start_time: int | None = None,
    ) -> RequestSpan:
        """A SERVER span whose parent is the request's own `trace_context` (traceparent, tracestate)
        when given, else the traceparent in the call's metadata (if any). It starts before the request
        is converted: it holds what is known of every request, even one refused. `operation` None: the
        span of a call refused before any request of it was read (see `refusals`)."""
        if trace_context:
            carrier = {key.lower(): value for key, value in trace_context.items()}
        else:
            carrier = {key: value for key, value in call.metadata if isinstance(value, str)}
        parent = _PROPAGATOR.extract(carrier=carrier)
        attributes = {
            "gen_ai.system": "sluice",
            "rpc.system": "grpc",
            "rpc.service": call.rpc_service,
            "rpc.method": call.rpc_method,
        }
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
        if self._model_name is not None:
            attributes["gen_ai.request.model"] = self._model_name
        name = self._span_name(call, operation)
        span = self._tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes, start_time=start_time
        )
        return RequestSpan(span, call)

    def _span_name(self, call: Call, operation: str | None) -> str:
        """gen_ai's "{operation} {model}", "{operation}" while the model loads; with no request (no
        operation), as OTel names RPC spans: "{rpc.service}/{rpc.method}"."""
        if operation is None:
            return f"{call.rpc_service}/{call.rpc_method}"
        return operation if self._model_name is None else f"{operation} {self._model_name}"

    @contextlib.contextmanager
    def refusals(
        self, call: Call, operation: str | None, trace_context: Mapping[str, str] | None = None
    ) -> Iterator[None]:
        """Around the checks a call or request passes before its own span starts (its API key, the
        server accepting: not loading, draining or failed, its request id): an exception out of the
        block is recorded as the refused request's one span, from the block's start, ended as
        RequestSpan ends a refused request; a block that passes records nothing (the request's own span
        comes next). `operation` None: the call is refused whole, before any request of it was read."""
        start_time = time.time_ns()
        try:
            yield
        except Exception:
            with self.start(call, operation, trace_context, start_time):
                raise


class RequestSpan:
    """The span of one request, open (`with`) around the request's whole generation path. How that
    block ends gives the call's status (rpc.grpc.status_code) and the span's, then ends the span:

        completed                  OK                  UNSET
        raised (refused, failed)   as the caller gets  ERROR, error.type: the exception's class
        cancelled at the deadline  DEADLINE_EXCEEDED   ERROR, error.type: "DEADLINE_EXCEEDED"
        cancelled by the caller    CANCELLED           UNSET
    """

    def __init__(self, span: Span, call: CallDeadline) -> None:
        self._span = span
        self._call = call

    def record_params(self, params: SamplingParams) -> None:
        """The request's sampling parameters, once converted."""
        attributes: dict[str, int | float] = {
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
        }
        if params.top_k:
            attributes["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        if params.n != 1:
            attributes["gen_ai.request.choice.count"] = params.n
        self._span.set_attributes(attributes)

    def record_final(self, final: RequestOutput, finish_reasons: Sequence[str]) -> None:
        """Usage, each sample's finish reason, preemptions and the request's life events (stamped when they
        happened; first_token: the first sample's)."""
        span = self._span
        span.set_attribute("gen_ai.response.finish_reasons", tuple(finish_reasons))
        span.set_attribute("sluice.num_preemptions", final.num_preemptions)
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
        if timings.finished is not None:
            attributes = {"finish_reason": final.finish_reason}
            span.add_event("finished", attributes, timestamp=_ns(timings.finished))

    def __enter__(self) -> RequestSpan:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc is None:
            code = grpc.StatusCode.OK
        elif isinstance(exc, GeneratorExit | asyncio.CancelledError):  # the call was cancelled
            code = cancelled_status(self._call)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._set_error(code.name, "the call's deadline passed")
        else:
            code, message = status_for(exc)
            self._set_error(type(exc).__name__, message)
        self._span.set_attribute("rpc.grpc.status_code", code.value[0])
        self._span.end()

    def _set_error(self, error_type: str, message: str) -> None:
        self._span.set_status(Status(StatusCode.ERROR, message or error_type))
        self._span.set_attribute("error.type", error_type)
