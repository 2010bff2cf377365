"""Pure parts of the gRPC edge: proto <-> engine conversion, status mapping, auth, metrics, tracing, CLI."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from sluice import Completion, SluiceError, generate_request
from sluice.engine.errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    UnknownRequestError,
)
from sluice.engine.frontend.kv_event_log import EngineStoppedError, ReplayExpiredError, SubscriberLagError
from sluice.engine.model_info import ModelInfo
from sluice.engine.outputs import (
    NO_OUTPUT_LOGPROBS,
    OutputLogprobs,
    PromptLogprobs,
    RequestOutput,
    Timings,
    Usage,
)
from sluice.engine.sampling_params import SamplingParams
from sluice.service import convert
from sluice.service.auth import check_api_key
from sluice.service.cli import build_parser, load_commands
from sluice.service.engine_args import parse_size
from sluice.service.metrics import ServerMetrics
from sluice.service.serve_command import engine_config
from sluice.service.status import (
    MAX_MESSAGE_BYTES,
    RequestFailedError,
    ServiceUnavailableError,
    failure_status,
    status_for,
)
from sluice.service.tracing import tracer_provider_from_env
from sluice.v1 import sluice_pb2 as pb


def _final_output(**overrides: object) -> RequestOutput:
    fields = {
        "request_id": "engine-1",
        "token_ids": (7, 9),
        "text": "hi",
        "logprobs": OutputLogprobs([7, 9], [-0.5, -0.75], 2, [7, 3, 9, 4], [-0.5, -1.25, -0.75, -2.0]),
        "finish_reason": "stop",
        "stop_reason": "###",
        "usage": Usage(prompt_tokens=5, completion_tokens=4, cached_tokens=2),
        "timings": Timings(arrival=100.0, first_scheduled=100.5, first_token=101.0, finished=103.0),
        "num_preemptions": 1,
    }
    fields.update(overrides)
    return RequestOutput(**fields)


def test_absent_sampling_fields_keep_engine_defaults() -> None:
    assert convert.sampling_params_from_proto(pb.SamplingParams()) == SamplingParams()


def test_every_sampling_field_is_copied() -> None:
    message = pb.SamplingParams(
        temperature=0.0,
        top_k=5,
        top_p=0.5,
        min_p=0.25,
        repetition_penalty=1.5,
        presence_penalty=-0.5,
        frequency_penalty=0.75,
        seed=12345678901,
        max_tokens=33,
        min_tokens=2,
        stop=["\n\n", "END"],
        stop_token_ids=[4, 5],
        ignore_eos=True,
        logprobs=3,
        skip_special_tokens=False,
        n=4,
        prompt_logprobs=2,
    )
    expected = SamplingParams(
        temperature=0.0,
        top_k=5,
        top_p=0.5,
        min_p=0.25,
        repetition_penalty=1.5,
        presence_penalty=-0.5,
        frequency_penalty=0.75,
        seed=12345678901,
        max_tokens=33,
        min_tokens=2,
        stop=("\n\n", "END"),
        stop_token_ids=(4, 5),
        ignore_eos=True,
        logprobs=3,
        skip_special_tokens=False,
        n=4,
        prompt_logprobs=2,
    )
    assert convert.sampling_params_from_proto(message) == expected


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (pb.SamplingParams(top_p=0.0), "top_p: must be in (0, 1]"),
        (pb.SamplingParams(max_tokens=-1), "max_tokens: must be >= 1"),
        (pb.SamplingParams(logprobs=21), "logprobs: must be in [0, 20]"),
        (pb.SamplingParams(temperature=-1.0), "temperature: must be >= 0"),
    ],
)
def test_bad_sampling_field_is_named(message: pb.SamplingParams, error: str) -> None:
    with pytest.raises(ValueError) as info:
        convert.sampling_params_from_proto(message)
    assert str(info.value) == error


_FLOAT_SAMPLING_FIELDS = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.type == f.TYPE_FLOAT]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", _FLOAT_SAMPLING_FIELDS)
def test_non_finite_float_fields_are_refused_by_name(name: str, value: float) -> None:
    with pytest.raises(ValueError) as info:
        convert.sampling_params_from_proto(pb.SamplingParams(**{name: value}))
    assert str(info.value) == f"{name}: must be a finite number, got {value}"


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_logit_bias_is_refused(value: float) -> None:
    message = pb.SamplingParams(logit_bias={7: value})
    with pytest.raises(ValueError) as info:
        convert.sampling_params_from_proto(message)
    assert str(info.value) == f"logit_bias: the bias of token 7 must be a finite number, got {value}"


def test_every_float_field_of_the_api_is_checked() -> None:
    """A float field added to SamplingParams without a finiteness check fails here."""
    assert set(_FLOAT_SAMPLING_FIELDS) == {
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    }
    map_fields = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.message_type is not None]
    assert "logit_bias" in map_fields


def test_prompt_oneof_maps_to_engine_keywords() -> None:
    assert convert.prompt_from_proto(pb.GenerateRequest(text="abc")) == convert.Prompt(text="abc")
    by_ids = pb.GenerateRequest(token_ids=pb.TokenIds(token_ids=[1, 2, 3]))
    assert convert.prompt_from_proto(by_ids) == convert.Prompt(token_ids=(1, 2, 3))
    chat = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hey")]))
    prompt = convert.prompt_from_proto(chat)
    assert prompt.messages == ({"role": "user", "content": "hey"},)
    assert (prompt.operation, convert.Prompt(text="x").operation) == ("chat", "text_completion")
    assert convert.prompt_from_proto(pb.GenerateRequest()).as_kwargs() == {
        "text": "",
        "token_ids": None,
        "messages": None,
        "chat_options": None,
    }


def test_final_output_becomes_last_chunk() -> None:
    response = convert.generate_response_from_output(_final_output(), "client-7")
    expected = pb.GenerateResponse(
        request_id="client-7",
        text="hi",
        token_ids=[7, 9],
        logprobs=[
            pb.Logprobs(
                sampled=pb.TokenLogprob(token_id=7, logprob=-0.5),
                top=[pb.TokenLogprob(token_id=7, logprob=-0.5), pb.TokenLogprob(token_id=3, logprob=-1.25)],
            ),
            pb.Logprobs(
                sampled=pb.TokenLogprob(token_id=9, logprob=-0.75),
                top=[pb.TokenLogprob(token_id=9, logprob=-0.75), pb.TokenLogprob(token_id=4, logprob=-2.0)],
            ),
        ],
        finish_reason=pb.FINISH_REASON_STOP,
        stop_string="###",
        usage=pb.Usage(prompt_tokens=5, completion_tokens=4, cached_tokens=2),
        timings=pb.Timings(queue_seconds=0.5, ttft_seconds=1.0, total_seconds=3.0),
    )
    assert response == expected


def test_sample_index_prompt_logprobs_and_computed_prompt_tokens_go_out() -> None:
    prompt_logprobs = PromptLogprobs([5], [-2.5], 1, [6], [-0.25])
    usage = Usage(prompt_tokens=5, completion_tokens=4, cached_tokens=0, prompt_tokens_computed=5)
    output = _final_output(index=3, prompt_logprobs=prompt_logprobs, usage=usage)
    response = asyncio.run(convert.generate_response(output, "c"))
    assert response.index == 3
    assert list(response.prompt_logprobs) == [
        pb.Logprobs(
            sampled=pb.TokenLogprob(token_id=5, logprob=-2.5),
            top=[pb.TokenLogprob(token_id=6, logprob=-0.25)],
        )
    ]
    assert response.usage == pb.Usage(prompt_tokens=5, completion_tokens=4, prompt_tokens_computed=5)


def _long_prompt_logprobs(num_top: int) -> PromptLogprobs:
    """Entries for two slices and a bit, with values a float32 holds exactly."""
    n = 2 * convert.PROMPT_LOGPROBS_PER_SLICE + 3
    tops = range(n * num_top)
    return PromptLogprobs(
        [i % 1000 for i in range(n)],
        [-(i % 64) / 8 for i in range(n)],
        num_top,
        [*tops],
        [-(j % 32) / 4 for j in tops],
    )


def test_long_prompt_logprobs_go_out_whole_and_in_order_with_the_loop_served_between_slices(
    monkeypatch,
) -> None:
    values = _long_prompt_logprobs(num_top=2)
    events: list[str] = []
    add_slice = convert.add_logprobs

    def recorded(entries: object, columns: object, start: int, end: int) -> None:
        if columns is values:  # not the sampled tokens' logprobs, which go in at once
            events.append("slice")
        add_slice(entries, columns, start, end)

    monkeypatch.setattr(convert, "add_logprobs", recorded)

    async def convert_with_another_task() -> pb.GenerateResponse:
        async def another() -> None:
            while True:
                events.append("other")
                await asyncio.sleep(0)

        task = asyncio.create_task(another())
        await asyncio.sleep(0)
        events.clear()
        response = await convert.generate_response(_final_output(prompt_logprobs=values), "c")
        task.cancel()
        return response

    response = asyncio.run(convert_with_another_task())
    got = [
        (e.sampled.token_id, e.sampled.logprob, [(t.token_id, t.logprob) for t in e.top])
        for e in response.prompt_logprobs
    ]
    expected = [
        (e.sampled.token_id, e.sampled.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in values
    ]
    assert got == expected and len(got) == len(values)
    assert events == ["slice", "other", "slice", "other", "slice"]


def test_delta_chunk_has_no_final_fields() -> None:
    delta = _final_output(
        token_ids=(4,), text="a", logprobs=NO_OUTPUT_LOGPROBS, finish_reason=None, stop_reason=None
    )
    response = convert.generate_response_from_output(delta, "c")
    assert response == pb.GenerateResponse(request_id="c", text="a", token_ids=[4])
    assert not response.HasField("usage") and response.WhichOneof("stop_reason") is None


@pytest.mark.parametrize(
    ("reason", "stop_reason", "enum", "oneof"),
    [
        ("length", None, pb.FINISH_REASON_LENGTH, None),
        ("abort", None, pb.FINISH_REASON_ABORT, None),
        ("error", None, pb.FINISH_REASON_ERROR, None),
        ("stop", 2, pb.FINISH_REASON_STOP, "stop_token_id"),
    ],
)
def test_finish_reasons(reason: str, stop_reason: int | None, enum: int, oneof: str | None) -> None:
    out = _final_output(finish_reason=reason, stop_reason=stop_reason)
    response = convert.generate_response_from_output(out, "c")
    assert response.finish_reason == enum
    assert response.WhichOneof("stop_reason") == oneof


def test_timings_of_request_aborted_in_queue_read_zero() -> None:
    timings = Timings(arrival=10.0, first_scheduled=None, first_token=None, finished=12.5)
    assert convert.timings_to_proto(timings) == pb.Timings(total_seconds=2.5)


def test_model_info() -> None:
    info = ModelInfo(
        "tiny", "LlamaForCausalLM", 256, 512, (2, 3), 16, 40, max_num_batched_tokens=8192, max_num_seqs=128
    )
    assert convert.model_info_to_proto(info) == pb.GetModelInfoResponse(
        model_name="tiny",
        architecture="LlamaForCausalLM",
        max_model_len=256,
        vocab_size=512,
        eos_token_ids=[2, 3],
        block_size=16,
        num_kv_blocks=40,
        kv_capacity_tokens=640,
        max_num_batched_tokens=8192,
        max_num_seqs=128,
    )


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (QueueFullError("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
        (
            ContextLengthError("max_tokens", "too long"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "max_tokens: too long",
        ),
        (InvalidRequestError("top_k", "bad"), grpc.StatusCode.INVALID_ARGUMENT, "top_k: bad"),
        (
            ValueError("top_p: must be in (0, 1]"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p: must be in (0, 1]",
        ),
        (
            UnknownRequestError("r9"),
            grpc.StatusCode.NOT_FOUND,
            "request_id: no request with id 'r9'",
        ),
        (ServiceUnavailableError("draining"), grpc.StatusCode.UNAVAILABLE, "draining"),
        (EngineDeadError("exit code 1"), grpc.StatusCode.UNAVAILABLE, "the engine failed: exit code 1"),
        (RequestFailedError("nan logits"), grpc.StatusCode.INTERNAL, "nan logits"),
        # A KV event subscription (SMG's SubscribeKvEvents): its cursor, its lag, the engine's end.
        (
            ReplayExpiredError("cursor 3 is gone"),
            grpc.StatusCode.OUT_OF_RANGE,
            "start_sequence_number: cursor 3 is gone",
        ),
        (
            SubscriberLagError("1024 batches"),
            grpc.StatusCode.DATA_LOSS,
            "the subscriber fell behind: 1024 batches",
        ),
        (EngineStoppedError("shutdown"), grpc.StatusCode.UNAVAILABLE, "the engine stopped: shutdown"),
        (RuntimeError("secret detail"), grpc.StatusCode.INTERNAL, "internal error: RuntimeError"),
    ],
)
def test_exceptions_map_to_status(exc: Exception, code: grpc.StatusCode, message: str) -> None:
    assert status_for(exc) == (code, message)


def test_a_long_message_is_cut_to_whole_characters_within_the_bound() -> None:
    """A message quoting 1,000 two-byte characters: its first 1,024 bytes stop inside one, which goes."""
    code, message = status_for(InvalidRequestError("stops", "é" * 1000))  # 7 + 2,000 bytes
    assert MAX_MESSAGE_BYTES == 1024
    assert (code, message) == (grpc.StatusCode.INVALID_ARGUMENT, f"stops: {'é' * 508}... (984 more bytes)")
    assert status_for(InvalidRequestError("stop", "é" * 509))[1] == f"stop: {'é' * 509}"  # 1,024: kept


def test_only_the_servers_own_failures_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert failure_status(QueueFullError("full")) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert failure_status(ValueError("top_p: bad")) == (grpc.StatusCode.INVALID_ARGUMENT, "top_p: bad")
    assert caplog.records == []
    internal = (grpc.StatusCode.INTERNAL, "internal error: RuntimeError")
    assert failure_status(RuntimeError("secret detail")) == internal
    (record,) = caplog.records
    assert (record.levelname, record.getMessage()) == ("ERROR", "request failed")
    assert record.exc_info[1].args == ("secret detail",)


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ((("authorization", "Bearer k3y"),), None),
        ((("authorization", "bearer k3y"),), None),
        ((), "authorization: missing; send 'authorization: Bearer <api key>' metadata"),
        ((("authorization", "k3y"),), "authorization: must be 'Bearer <api key>'"),
        ((("authorization", "Bearer wrong"),), "authorization: invalid API key"),
    ],
)
def test_api_key_check(metadata: tuple[tuple[str, str], ...], reason: str | None) -> None:
    assert check_api_key(metadata, "k3y") == reason


def test_request_tracker_counts_a_finished_request() -> None:
    metrics = ServerMetrics(lambda: None)
    tracker = metrics.track()
    value = metrics.registry.get_sample_value
    default = {"tenant": "default"}
    usage = Usage(prompt_tokens=5, completion_tokens=1, cached_tokens=2)
    tracker.on_output(RequestOutput(request_id="e", token_ids=(1,), text="a", usage=usage))
    # The tokens count while the request runs (a long one moves the throughput panel before it ends).
    assert value("sluice_prompt_tokens_total", default) == 5
    assert value("sluice_generation_tokens_total", default) == 1
    usage = Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)
    tracker.on_output(RequestOutput(request_id="e", token_ids=(2, 3), text="bc", usage=usage))
    tracker.finish(_final_output(), ("stop",))
    assert value("sluice_requests_total", {"finish_reason": "stop", **default}) == 1
    assert value("sluice_prompt_tokens_total", default) == 5
    assert value("sluice_generation_tokens_total", default) == 3
    assert value("sluice_cached_tokens_total", default) == 2
    assert value("sluice_inter_token_latency_seconds_count") == 2  # two tokens in the second chunk
    assert value("sluice_time_to_first_token_seconds_sum") == 1.0
    assert value("sluice_queue_time_seconds_sum") == 0.5
    assert value("sluice_e2e_request_latency_seconds_sum") == 3.0
    assert value("sluice_num_requests_running") is None  # no engine yet: no gauges


def test_a_request_ended_before_its_first_token_counts_no_prompt_tokens() -> None:
    """vLLM counts a prompt at its first token: one aborted or expired while it waited, whose last output
    still reports its prompt, counted it (and one its caller cancelled, ending without that output, not)."""
    metrics = ServerMetrics(lambda: None)
    tracker = metrics.track()
    usage = Usage(prompt_tokens=183, completion_tokens=0, cached_tokens=16)
    timings = Timings(arrival=100.0, first_scheduled=None, first_token=None, finished=101.0)
    ended = RequestOutput("e", (), "", finish_reason="abort", usage=usage, timings=timings)
    tracker.on_output(ended)
    tracker.finish(ended, ("abort",))
    value = metrics.registry.get_sample_value
    default = {"tenant": "default"}
    counted = [value(f"sluice_{name}_tokens_total", default) or 0 for name in ("prompt", "cached")]
    assert counted == [0, 0]
    assert value("sluice_requests_total", {"finish_reason": "abort", **default}) == 1


def test_request_latencies_have_buckets_past_a_minute() -> None:
    """They ended at 60 s: every quantile of a 5-minute request (or queue wait) read 60."""
    metrics = ServerMetrics(lambda: None)
    tracker = metrics.track()
    timings = Timings(arrival=0.0, first_scheduled=130.0, first_token=200.0, finished=300.0)
    tracker.finish(_final_output(timings=timings), ("stop",))
    value = metrics.registry.get_sample_value
    for name, seconds, (below, above) in (
        ("sluice_queue_time_seconds", 130.0, ("120.0", "240.0")),
        ("sluice_time_to_first_token_seconds", 200.0, ("120.0", "240.0")),
        ("sluice_e2e_request_latency_seconds", 300.0, ("240.0", "480.0")),
    ):
        counts = [value(f"{name}_bucket", {"le": le}) for le in (below, above)]
        assert (value(f"{name}_sum"), counts) == (seconds, [0, 1]), name


@pytest.mark.parametrize(
    ("environ", "enabled"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": " OTLP , none"}, True),  # the spec's list; otlp in it exports
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, False),
    ],
)
def test_tracer_provider_from_env(environ: dict[str, str], enabled: bool) -> None:
    provider = tracer_provider_from_env(environ)
    assert (provider is not None) == enabled
    if provider is not None:
        provider.shutdown()


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])
def test_an_otlp_protocol_other_than_grpc_is_refused_naming_the_variable(variable: str) -> None:
    """The gRPC exporter was used whatever the protocol said: a collector on http/protobuf got nothing."""
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", variable: "http/protobuf"}
    with pytest.raises(ValueError, match=rf"^{variable}: 'http/protobuf' is not supported"):
        tracer_provider_from_env(environ)


def test_an_exporter_other_than_otlp_is_refused_naming_the_variable() -> None:
    """ "otlp,console" (the spec's list) turned tracing off without a word: it was compared whole."""
    with pytest.raises(ValueError, match=r"^OTEL_TRACES_EXPORTER: 'console' not supported"):
        tracer_provider_from_env({"OTEL_TRACES_EXPORTER": "otlp,console"})


def test_the_traces_own_protocol_wins_over_the_general_one() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",  # for metrics or logs, say
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
    }
    tracer_provider_from_env(environ).shutdown()


@pytest.mark.parametrize(
    ("resource_attributes", "service_name", "expected"),
    [
        ("", None, "sluice"),
        ("deployment.environment=prod", None, "sluice"),
        ("service.name=checkout-llm,deployment.environment=prod", None, "checkout-llm"),
        ("service.name=checkout-llm", "from-otel-service-name", "from-otel-service-name"),
    ],
)
def test_the_service_name_is_the_environments_else_sluice(
    monkeypatch: pytest.MonkeyPatch, resource_attributes: str, service_name: str | None, expected: str
) -> None:
    """OTEL_RESOURCE_ATTRIBUTES' service.name was overridden with "sluice"."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", resource_attributes)
    if service_name is None:
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    else:
        monkeypatch.setenv("OTEL_SERVICE_NAME", service_name)
    provider = tracer_provider_from_env()
    try:
        assert provider.resource.attributes["service.name"] == expected
    finally:
        provider.shutdown()


def test_client_request_builder_sets_only_given_fields() -> None:
    request = generate_request(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)
    assert request.WhichOneof("prompt") == "messages"
    sampling = request.sampling_params
    assert sampling.HasField("temperature") and sampling.temperature == 0.0
    assert not sampling.HasField("top_p")
    assert convert.sampling_params_from_proto(sampling) == SamplingParams(temperature=0.0, max_tokens=4)


def test_client_completion_collects_chunks() -> None:
    completion = Completion()
    completion.add(pb.GenerateResponse(request_id="a", text="he", token_ids=[1]))
    completion.add(
        pb.GenerateResponse(
            request_id="a",
            text="llo",
            token_ids=[2],
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=3),
        )
    )
    assert (completion.text, completion.token_ids, completion.finish_reason_name) == (
        "hello",
        [1, 2],
        "length",
    )
    assert completion.usage.prompt_tokens == 3
    error = SluiceError(grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1]")
    assert str(error) == "INVALID_ARGUMENT: top_p: must be in (0, 1]"


def test_serve_arguments_build_engine_config() -> None:
    assert parse_size("2GiB") == 2 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("1000") == 1000
    parser = build_parser(load_commands())
    args = parser.parse_args(
        [
            "serve",
            "--preset",
            "llama-tiny",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "64MiB",
            "--no-prefix-caching",
        ]
    )
    config = engine_config(args)
    assert (config.model.load_format, config.model.preset) == ("dummy", "llama-tiny")
    assert (config.cache.block_size, config.cache.kv_cache_memory_bytes) == (32, 64 << 20)
    assert config.cache.enable_prefix_caching is False and config.scheduler.enable_chunked_prefill is True


def test_chat_template_kwargs_reach_the_template_with_whole_numbers_as_ints_at_any_depth() -> None:
    """A Struct holds every number as a double: 512 would print as 512.0 in a template, also inside a
    nested object or list (JSON parsing, as vLLM takes the kwargs, gives 512)."""
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    chat.chat_template_kwargs.update({"budget": {"tokens": 512, "shares": [1, 0.5]}, "depth": 2, "on": True})
    kwargs = convert.chat_options_from_proto(chat).chat_template_kwargs
    assert kwargs == {"budget": {"tokens": 512, "shares": [1, 0.5]}, "depth": 2, "on": True}
    numbers = [kwargs["depth"], kwargs["budget"]["tokens"], *kwargs["budget"]["shares"]]
    assert [type(number) for number in numbers] == [int, int, int, float]
