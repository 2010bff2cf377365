"""Constraints and tools over real gRPC: a tiny random-weight Llama behind the real server."""

from __future__ import annotations

import json
import re
import shutil

import grpc
import jsonschema
import pytest
from checkpoints import CHAT_TEMPLATE
from service_harness import ServerThread, long_engine_config

from sluice import Client
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(120)

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}
WEATHER = pb.Tool(
    name="get_weather",
    description="Current weather in a city",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)
TIME = pb.Tool(name="get_time", description="The time now", parameters="")


def generate(stub, **params) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        text="hello there", sampling_params=pb.SamplingParams(**{"max_tokens": 120, **params})
    )
    return list(stub.Generate(request, timeout=60))


def text_of(chunks: list[pb.GenerateResponse]) -> str:
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
    return "".join(chunk.text for chunk in chunks)


def test_each_constraint_kind_holds_over_grpc(stub) -> None:
    value = json.loads(text_of(generate(stub, json_schema=json.dumps(SCHEMA), temperature=0.0)))
    jsonschema.validate(value, SCHEMA)
    assert re.fullmatch(r"[a-c]{2}[0-9]", text_of(generate(stub, regex=r"[a-c]{2}[0-9]", seed=3)))
    grammar = 'root ::= "<" [0-9]{1,2} ">"'
    assert re.fullmatch(r"<[0-9]{1,2}>", text_of(generate(stub, grammar=grammar, seed=4)))
    choice = pb.Choice(choices=["red", "green", "blue"])
    assert text_of(generate(stub, choice=choice, seed=5)) in {"red", "green", "blue"}


def test_allowed_token_ids_and_logit_bias_over_grpc(stub) -> None:
    chunks = generate(stub, allowed_token_ids=[40, 41, 42], logit_bias={42: -100.0}, max_tokens=8, seed=1)
    token_ids = [t for chunk in chunks for t in chunk.token_ids]
    assert len(token_ids) == 8 and set(token_ids) <= {40, 41}


@pytest.mark.parametrize(
    ("params", "details"),
    [
        ({"json_schema": '{"type": "foo"}'}, 'json_schema: does not compile: Unsupported type "foo"'),
        ({"json_schema": "{"}, "json_schema: is not valid JSON: "),
        ({"json_schema": "[1, 2]"}, "json_schema: must be a JSON object"),
        ({"regex": ""}, "regex: must not be empty"),
        ({"grammar": ""}, "grammar: must not be empty"),
        (
            {"regex": "a(b"},
            "regex: does not compile: Regex parsing error at position 4: The parenthesis is not closed.",
        ),
        (
            {"grammar": "root ::= foo"},
            'grammar: does not compile: EBNF parser error at line 1, column 10: Rule "foo" is not defined',
        ),
        (
            {"regex": "[0-9]+$[a-z]"},
            "regex: the pattern has the anchor '$' at position 6, which xgrammar drops inside a pattern",
        ),
        (
            {"json_schema": '{"type": "string", "pattern": "^(?!admin$)[a-z]+$"}'},
            "json_schema: 'pattern' at # is a keyword the grammar cannot enforce (xgrammar), so the output "
            "could break it; leave it out ('^(?!admin$)[a-z]+$' has the lookahead '(?!' at position 1, "
            "which xgrammar drops)",
        ),
        ({"choice": pb.Choice()}, "choice: must hold at least one non-empty string"),
        # Compiles, but no string matches it: the first mask is empty.
        ({"grammar": "root ::= root"}, "grammar: accepts no token at output token 0"),
        ({"logit_bias": {600: 1.0}}, "logit_bias: token id 600 is outside the vocabulary [0, 512)"),
        ({"allowed_token_ids": [512]}, "allowed_token_ids: token id 512 is outside the vocabulary [0, 512)"),
        (
            {"allowed_token_ids": [40, 41], "stop_token_ids": [40, 41], "min_tokens": 2},
            "min_tokens: holds back every allowed_token_ids entry (each is a stop token or eos)",
        ),
    ],
)
def test_a_bad_constraint_is_invalid_argument_naming_the_field(stub, params, details) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **params)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(details), info.value.details()


def test_a_constraint_that_does_not_compile_is_reported_in_band_on_stream_generate(stub) -> None:
    bad = pb.GenerateRequest(request_id="bad", text="x", sampling_params=pb.SamplingParams(regex="(("))
    # Greedy and past EOS, so the good request's end is its length whatever token the random model picks.
    greedy = pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    good = pb.GenerateRequest(request_id="good", text="x", sampling_params=greedy)
    requests = [pb.StreamGenerateRequest(generate=bad), pb.StreamGenerateRequest(generate=good)]
    responses = list(stub.StreamGenerate(iter(requests), timeout=60))
    errors = [r for r in responses if r.WhichOneof("event") == "error"]
    assert [(r.request_id, r.error.code) for r in errors] == [
        ("bad", grpc.StatusCode.INVALID_ARGUMENT.value[0])
    ]
    assert errors[0].error.message.startswith("regex: does not compile: ")
    good_chunks = [r.chunk for r in responses if r.request_id == "good"]
    assert good_chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_constraint_ends_the_output_even_with_ignore_eos_and_min_tokens(stub) -> None:
    choice = pb.Choice(choices=["red", "green", "blue"])
    chunks = generate(stub, choice=choice, ignore_eos=True, min_tokens=50, max_tokens=60, seed=7)
    assert text_of(chunks) in {"red", "green", "blue"}


def test_allowed_token_ids_that_leave_the_constraint_nothing_end_the_call_invalid_argument(stub) -> None:
    """The first token streams; at the second the constraint needs a token allowed_token_ids excludes."""
    red = [
        t
        for chunk in generate(stub, choice=pb.Choice(choices=["red"]), temperature=0.0)
        for t in chunk.token_ids
    ]
    request = pb.GenerateRequest(
        request_id="dead-end",
        text="hello there",
        sampling_params=pb.SamplingParams(choice=pb.Choice(choices=["red"]), allowed_token_ids=red[:1]),
    )
    chunks = []
    with pytest.raises(grpc.RpcError) as info:
        chunks.extend(stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        info.value.details() == "allowed_token_ids: none is a token the constraint accepts at output token 1"
    )
    assert [t for chunk in chunks for t in chunk.token_ids] == red[:1]
    # In band on StreamGenerate: the request ends with the same error, the stream and its others go on.
    greedy = pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    good = pb.GenerateRequest(request_id="good", text="x", sampling_params=greedy)
    requests = [pb.StreamGenerateRequest(generate=request), pb.StreamGenerateRequest(generate=good)]
    responses = list(stub.StreamGenerate(iter(requests), timeout=60))
    errors = [
        (r.request_id, r.error.code, r.error.message) for r in responses if r.WhichOneof("event") == "error"
    ]
    assert errors == [("dead-end", grpc.StatusCode.INVALID_ARGUMENT.value[0], info.value.details())]
    assert [r.chunk for r in responses if r.request_id == "good"][-1].finish_reason == pb.FINISH_REASON_LENGTH


def chat_request(tool_choice: pb.ToolChoice | None, **params) -> pb.GenerateRequest:
    messages = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="What is the weather in Paris?")],
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
    )
    sampling = pb.SamplingParams(**{"max_tokens": 120, **params})
    return pb.GenerateRequest(messages=messages, sampling_params=sampling)


def chat(stub, tool_choice: pb.ToolChoice | None, **params) -> list[pb.GenerateResponse]:
    return list(stub.Generate(chat_request(tool_choice, **params), timeout=60))


def test_required_tool_choice_returns_parsed_calls_of_the_tools(stub) -> None:
    chunks = chat(stub, pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), seed=2)
    text = text_of(chunks)
    calls = chunks[-1].tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (call["name"], call["arguments"]) for call in json.loads(text)
    ]
    assert calls and all(c.name in {"get_weather", "get_time"} for c in calls)
    assert all(not chunk.tool_calls for chunk in chunks[:-1])


def test_named_tool_choice_returns_one_call_of_that_function(stub) -> None:
    chunks = chat(stub, pb.ToolChoice(function_name="get_weather"), temperature=0.0)
    arguments = json.loads(text_of(chunks))
    jsonschema.validate(arguments, json.loads(WEATHER.parameters))
    assert [(c.name, json.loads(c.arguments)) for c in chunks[-1].tool_calls] == [("get_weather", arguments)]


def test_a_tool_named_like_a_mode_is_called_when_function_name_names_it(stub) -> None:
    """function_name "none" was read as the mode none: no constraint and no call parsed."""
    called_none = pb.Tool(name="none", description=WEATHER.description, parameters=WEATHER.parameters)
    request = chat_request(pb.ToolChoice(function_name="none"), temperature=0.0)
    request.messages.tools.append(called_none)
    chunks = list(stub.Generate(request, timeout=60))
    arguments = json.loads(text_of(chunks))
    jsonschema.validate(arguments, json.loads(WEATHER.parameters))
    assert [(c.name, json.loads(c.arguments)) for c in chunks[-1].tool_calls] == [("none", arguments)]


def test_the_clients_completion_keeps_the_tool_calls(stub, server) -> None:
    """`Client.complete` collects the last chunk's parsed calls as the raw stream has them."""
    request = chat_request(pb.ToolChoice(function_name="get_weather"), temperature=0.0)
    chunks = list(stub.Generate(request, timeout=60))
    with Client(server.target) as client:
        completion = client.complete(request, timeout=60)
    assert completion.text == text_of(chunks)
    assert [c.name for c in completion.tool_calls] == ["get_weather"]
    assert [(c.name, c.arguments) for c in completion.tool_calls] == [
        (c.name, c.arguments) for c in chunks[-1].tool_calls
    ]
    assert completion.tool_calls[0].id != chunks[-1].tool_calls[0].id  # two calls, two ids


def test_an_unknown_tool_choice_mode_is_invalid_argument(stub) -> None:
    """It ran as auto (unconstrained)."""
    with pytest.raises(grpc.RpcError) as info:
        chat(stub, pb.ToolChoice(mode=7))
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "tool_choice.mode: unknown value 7",
    )


def test_tool_choice_naming_an_unknown_function_is_invalid_argument(stub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        chat(stub, pb.ToolChoice(function_name="nope"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        info.value.details()
        == "tool_choice.function_name: 'nope' is not one of the tools ['get_weather', 'get_time']"
    )


@pytest.mark.parametrize(
    "tool_choice", [pb.ToolChoice(function_name="bad"), pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)]
)
def test_a_tool_schema_that_does_not_compile_is_refused_naming_the_tools_parameters(
    stub, tool_choice
) -> None:
    """The grammar built from the tools' schemas did not compile: the error named json_schema, a field
    the request never set."""
    request = chat_request(tool_choice)
    dangling = json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    request.messages.tools.append(pb.Tool(name="bad", parameters=dangling))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("tools.parameters: does not compile: "), info.value.details()


def test_tokenize_renders_and_checks_a_chat_as_generate_does(llama_long_dir, tmp_path) -> None:
    """Tokenize left the tools out of the template and took what Generate refuses (an empty role,
    tool_choice without tools). Here the template renders the tools it is given."""
    directory = tmp_path / "llama"
    shutil.copytree(llama_long_dir, directory)
    template = (
        "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}" + CHAT_TEMPLATE
    )
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    if (directory / "chat_template.jinja").exists():
        (directory / "chat_template.jinja").write_text(template)
    thread = ServerThread(long_engine_config(str(directory))).start()
    try:
        with thread.channel() as channel:
            stub = thread.stub(channel)
            request = chat_request(pb.ToolChoice(function_name="get_weather"), max_tokens=1, temperature=0.0)
            tokenized = stub.Tokenize(pb.TokenizeRequest(messages=request.messages), timeout=60).token_ids
            without_tools = pb.ChatMessages(messages=request.messages.messages)
            plain = stub.Tokenize(pb.TokenizeRequest(messages=without_tools), timeout=60).token_ids
            (*_, last) = stub.Generate(request, timeout=60)
            assert len(tokenized) == last.usage.prompt_tokens > len(plain)
            refused = [
                (
                    pb.ChatMessages(messages=[pb.ChatMessage(role="", content="hi")]),
                    "messages[0].role: must not be empty",
                ),
                (
                    pb.ChatMessages(
                        messages=without_tools.messages, tool_choice=pb.ToolChoice(function_name="x")
                    ),
                    "tool_choice: needs tools",
                ),
            ]
            for messages, details in refused:
                with pytest.raises(grpc.RpcError) as info:
                    stub.Tokenize(pb.TokenizeRequest(messages=messages), timeout=60)
                assert (info.value.code(), info.value.details()) == (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    details,
                )
    finally:
        thread.stop()
