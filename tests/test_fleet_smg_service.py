"""vllm.grpc.engine.VllmEngine on a real Sluice server, called through smg-grpc-proto's generated stubs
as SMG calls it: health across the server's life, the tokenizer bundle, token ids in and out equal to
sluice.v1's answer, Abort, and the status codes of what Sluice does not do."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import threading
import zipfile

import grpc
import pytest
from checkpoints import LONG_CONTEXT
from service_harness import LONG_NUM_BLOCKS, UNENDING_TOKENS, ServerThread, tiny_engine_config
from smg_grpc_proto import vllm_engine_pb2 as smg
from smg_grpc_proto import vllm_engine_pb2_grpc as smg_grpc
from smg_grpc_proto.generated import common_pb2

from sluice import Client, generate_request
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine_stub(server: ServerThread):
    with server.channel() as channel:
        yield smg_grpc.VllmEngineStub(channel)


def _generate(stub, prompt: list[int], stream: bool, **sampling) -> list[smg.GenerateResponse]:
    request = smg.GenerateRequest(
        request_id=f"t-{hash((tuple(prompt), stream, tuple(sampling.items())))}",
        tokenized=smg.TokenizedInput(input_ids=prompt),
        sampling_params=smg.SamplingParams(**sampling),
        stream=stream,
    )
    return list(stub.Generate(request, timeout=60))


def test_token_ids_in_and_out_equal_sluices_own_answer(server: ServerThread, engine_stub) -> None:
    prompt = list(range(20, 60))
    with Client(server.target) as client:
        expected = client.complete(
            generate_request(token_ids=prompt, temperature=0.0, max_tokens=9, ignore_eos=True), timeout=60
        )
    streamed = _generate(engine_stub, prompt, True, temperature=0.0, max_tokens=9, ignore_eos=True)
    chunks = [r.chunk for r in streamed if r.WhichOneof("response") == "chunk"]
    (complete,) = [r.complete for r in streamed if r.WhichOneof("response") == "complete"]
    assert [t for c in chunks for t in c.token_ids] == list(expected.token_ids)
    assert (complete.finish_reason, complete.completion_tokens, complete.prompt_tokens) == ("length", 9, 40)
    (whole,) = _generate(engine_stub, prompt, False, temperature=0.0, max_tokens=9, ignore_eos=True)
    assert list(whole.complete.output_ids) == list(expected.token_ids)
    # The same prompt again: its full blocks come from the prefix cache.
    assert whole.complete.cached_tokens == 32


@pytest.mark.parametrize(
    "text_options", [{}, {"include_stop_str_in_output": True}, {"spaces_between_special_tokens": True}]
)
def test_a_stop_string_ends_with_the_tokens_that_complete_it(
    server: ServerThread, engine_stub, text_options: dict
) -> None:
    """SMG detokenizes and trims a stop string itself (its stop decoder, `no_stop_trim`), so the worker
    returns the ids through the token that completed it, whatever the text-only fields say."""
    prompt, greedy = list(range(20, 60)), {"temperature": 0.0, "max_tokens": 9, "ignore_eos": True}
    (whole,) = _generate(engine_stub, prompt, False, **greedy)
    decode, tokens = server.engine.tokenizer.decode, list(whole.complete.output_ids)
    stop = decode(tokens[:5])[len(decode(tokens[:3])) :].strip()  # a stretch of text past the start
    assert stop, f"no text to stop at in {decode(tokens)!r}"
    (stopped,) = _generate(engine_stub, prompt, False, stop=(stop,), **greedy, **text_options)
    ids = list(stopped.complete.output_ids)
    assert (stopped.complete.finish_reason, stopped.complete.matched_stop_str) == ("stop", stop)
    assert ids == tokens[: len(ids)] and stop in decode(ids) and stop not in decode(ids[:-1])


def test_text_is_tokenized_as_sluice_does_and_long_text_off_the_event_loop(
    server: ServerThread, engine_stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer, threads = server.engine.tokenizer, []
    encode = tokenizer.encode

    def spy(*args: object, **kwargs: object) -> list[int]:
        threads.append(threading.current_thread())
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    for text in ("Hello world", "Hello world " * 400):  # 4,800 characters: over TOKENIZE_INLINE_MAX_CHARS
        request = smg.GenerateRequest(
            text=text, sampling_params=smg.SamplingParams(temperature=0.0, max_tokens=1), stream=False
        )
        (whole,) = engine_stub.Generate(request, timeout=60)
        assert whole.complete.prompt_tokens == len(encode(text))
    loop_thread = server.call(_current_thread())
    assert [t is loop_thread for t in threads] == [True, False]


async def _current_thread() -> threading.Thread:
    return threading.current_thread()


def test_health_model_info_and_tokenizer_bundle(
    server: ServerThread, engine_stub, llama_long_dir: str
) -> None:
    """The module's server serves the long-context tiny Llama (`LONG_CONTEXT` positions)."""
    health = engine_stub.HealthCheck(smg.HealthCheckRequest(), timeout=10)
    assert health.healthy
    info = engine_stub.GetModelInfo(smg.GetModelInfoRequest(), timeout=10)
    assert (info.max_context_length, info.vocab_size, info.model_type) == (LONG_CONTEXT, 512, "llama")
    chunks = list(engine_stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=10))
    archive = b"".join(c.data for c in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(archive).hexdigest()
    files = zipfile.ZipFile(io.BytesIO(archive))
    assert sorted(files.namelist()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    with open(f"{llama_long_dir}/tokenizer.json") as f:
        original = json.load(f)
    assert json.loads(files.read("tokenizer.json"))["model"]["vocab"] == original["model"]["vocab"]
    loads = engine_stub.GetLoads(smg.GetLoadsRequest(), timeout=10)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens == LONG_NUM_BLOCKS * 16
    server_info = engine_stub.GetServerInfo(smg.GetServerInfoRequest(), timeout=10)
    assert (server_info.block_size, server_info.max_num_seqs) == (16, 64)
    # Where the grammar starts, which shapes SMG's forced tool-call grammars: no parser holds it back.
    assert server_info.engine_reasoning_parser == ""
    assert server_info.constrained_decoding_start == "first_token"


def test_abort_ends_a_live_request_and_ignores_unknown_ids(server: ServerThread, engine_stub) -> None:
    request = smg.GenerateRequest(
        request_id="to-abort",
        tokenized=smg.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=smg.SamplingParams(temperature=0.0, max_tokens=UNENDING_TOKENS, ignore_eos=True),
        stream=True,
    )
    responses = engine_stub.Generate(request, timeout=60)
    next(responses)
    engine_stub.Abort(smg.AbortRequest(request_ids=["to-abort", "never-seen"]), timeout=10)
    (complete,) = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    assert complete.finish_reason == "abort" and complete.completion_tokens < UNENDING_TOKENS
    server.wait_idle()


@pytest.mark.parametrize(
    ("bad", "details"),
    [
        ("x" * 513, "request_ids: must be at most 512 bytes (UTF-8), got 513"),
        ("", "request_ids: must not contain empty ids"),
    ],
)
def test_abort_refuses_an_id_over_512_bytes_or_empty(engine_stub, bad: str, details: str) -> None:
    """And aborts none of the ids beside it (the ones before it were aborted, or remembered as early
    aborts: a Generate with such an id ended at once)."""
    with pytest.raises(grpc.RpcError) as info:
        engine_stub.Abort(smg.AbortRequest(request_ids=[fine := f"fine-{len(bad)}", bad]), timeout=10)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    request = smg.GenerateRequest(
        request_id=fine,
        tokenized=smg.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=smg.SamplingParams(max_tokens=2, ignore_eos=True),
    )
    (response,) = engine_stub.Generate(request, timeout=60)
    assert (response.complete.finish_reason, len(response.complete.output_ids)) == ("length", 2)


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (
            {"max_tokens": LONG_CONTEXT},
            f"sampling_params.max_tokens: {LONG_CONTEXT} tokens after a 40-token prompt",
        ),
        ({"structural_tag": "{}"}, 'sampling_params.structural_tag: needs a "format" object'),
        ({"truncate_prompt_tokens": -2}, "sampling_params.truncate_prompt_tokens: must be -1"),
        ({"top_p": 2.0}, "sampling_params.top_p: must be in (0, 1]"),  # SamplingParams' own check
    ],
)
def test_what_cannot_run_is_invalid_argument(engine_stub, sampling: dict, message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _generate(engine_stub, list(range(20, 60)), True, **sampling)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message)


def test_a_structural_tag_without_type_is_taken_as_smgs_mistral_parser_sends_it(
    server: ServerThread, engine_stub
) -> None:
    """SMG's mistral tool parser (tool_choice "required" or named) sends xgrammar's form with no top-level
    "type", which xgrammar and vLLM take: every such request was INVALID_ARGUMENT."""
    call = {
        "type": "json_schema",
        "json_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    name = '{"name": "get_weather", "arguments": '
    tags = {
        "type": "tags_with_separator",
        "tags": [{"begin": name, "content": call, "end": "}"}],
        "separator": ", ",
    }
    tag = {
        "format": {
            "type": "triggered_tags",
            "triggers": ["[TOOL_CALLS]"],
            "tags": [{"begin": "[TOOL_CALLS] [", "content": tags, "end": "]"}],
            "at_least_one": True,
        }
    }
    responses = _generate(
        engine_stub, list(range(20, 40)), False, structural_tag=json.dumps(tag), max_tokens=80
    )
    text = server.engine.tokenizer.decode(list(responses[-1].complete.output_ids))
    assert text.startswith("[TOOL_CALLS] ["), text  # at_least_one: the tag's begin, whatever is sampled


def test_a_prompt_check_names_smgs_field(engine_stub) -> None:
    """The prompt checks shared with sluice.v1 say `token_ids`; SMG's request calls it tokenized.input_ids."""
    with pytest.raises(grpc.RpcError) as info:
        _generate(engine_stub, [20, 600], True, max_tokens=2)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "tokenized.input_ids: token id 600 is outside the vocabulary [0, 512)",
    )


def test_a_request_the_kv_cache_cannot_hold_is_invalid_argument(llama_long_dir: str) -> None:
    """Inside the context but over the whole KV cache, which only the engine core checks: INVALID_ARGUMENT
    as past the context (sluice.v1 says RESOURCE_EXHAUSTED, which SMG would retry), never INTERNAL."""
    thread = ServerThread(tiny_engine_config(llama_long_dir, num_blocks=8)).start()  # 128 tokens
    try:
        with thread.channel() as channel:
            stub = smg_grpc.VllmEngineStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                _generate(stub, list(range(20, 60)), True, max_tokens=100)
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "sampling_params.max_tokens: needs 9 KV blocks but the cache has 8",
            )
            # max_tokens unset: the prompt alone fills the cache (the default named max_tokens, 8192 blocks).
            with pytest.raises(grpc.RpcError) as info:
                _generate(stub, [20] * 128, True)
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "tokenized.input_ids: its 128 tokens and one generated need 9 KV blocks but the cache has 8",
            )
            assert thread.wait_idle().num_kv_blocks_used == 0
    finally:
        thread.stop()


def test_get_tokenizer_of_a_model_without_one_is_failed_precondition(
    llama_without_tokenizer_dir: str,
) -> None:
    """The server's state, not the empty request's fault: it was INVALID_ARGUMENT naming `tokenizer`, a
    field GetTokenizerRequest does not have."""
    thread = ServerThread(tiny_engine_config(llama_without_tokenizer_dir, num_blocks=8)).start()
    try:
        with thread.channel() as channel:
            stub = smg_grpc.VllmEngineStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.FAILED_PRECONDITION,
                "GetTokenizer: this model has no tokenizer (no tokenizer.json): send tokenized.input_ids",
            )
    finally:
        thread.stop()


def test_kv_events_without_the_flag_and_embeddings_are_unimplemented(engine_stub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(engine_stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "sluice serve --kv-events" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        engine_stub.Embed(smg.EmbedRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_health_follows_loading_and_draining(llama_dir: str) -> None:
    """With --served-model-name, both APIs call the model by it: SMG routes by that name (a model mounted
    at /models in the image was "models", and every OpenAI call naming its model failed)."""
    config = tiny_engine_config(llama_dir)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, served_model_name="fleet-llama")
    )
    thread = ServerThread(config).start(attach=False)
    try:
        with thread.channel() as channel:
            stub = smg_grpc.VllmEngineStub(channel)
            loading = stub.HealthCheck(smg.HealthCheckRequest(), timeout=10)
            assert (loading.healthy, loading.message) == (False, "the server is still loading the model")
            thread.attach()
            assert stub.HealthCheck(smg.HealthCheckRequest(), timeout=10).healthy
            info = stub.GetModelInfo(smg.GetModelInfoRequest(), timeout=10)
            own = thread.stub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert (info.served_model_name, info.model_path, own.model_name) == ("fleet-llama",) * 3
            thread.call(thread.server.begin_drain())
            draining = stub.HealthCheck(smg.HealthCheckRequest(), timeout=10)
            assert not draining.healthy and "draining" in draining.message
            with pytest.raises(grpc.RpcError) as info:
                _generate(stub, [5, 6, 7], True, max_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        thread.stop()
