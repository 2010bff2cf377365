"""Forced tool calls through the engine (tiny random llama): whatever the model samples, a required or
named call comes back as tool_calls, for tools whose schemas use "$defs" or give no "type". Over real
gRPC, a tool schema with a keyword the grammar cannot enforce is INVALID_ARGUMENT naming
`tools.parameters`."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from tool_schemas import forecast_tool

from sluice.engine.frontend.llm import LLM, Completion
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.tool_calls import Tool, ToolUse
from sluice.v1 import sluice_pb2 as pb

NUM_SEEDS = 6
CONVERSATION = [{"role": "user", "content": "What will the weather be in Oslo?"}]
FORECAST = forecast_tool(city_max_length=8)
# What clients send for a function without arguments.
TIME = Tool("get_time", "The time now", "{}")


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    return LLM(llama_dir, block_size=16, num_blocks=256, max_num_seqs=NUM_SEEDS, attention_backend="torch")


def sampled(llm: LLM, tool_use: ToolUse) -> list[Completion]:
    # Free strings and arrays rarely end by chance with this model; a bias towards closing them (applied
    # before the grammar's mask, so it allows nothing the grammar forbids) keeps outputs within max_tokens.
    # At 3.0 one seed in six drew a key of ~190 tokens (the draws of 2026-12-03): 6.0 closes within a few.
    bias = {llm.tokenizer.token_to_id(t): 6.0 for t in ('"', "}", "]")}
    params = [
        SamplingParams(max_tokens=200, temperature=1.0, seed=seed, logit_bias=bias)
        for seed in range(NUM_SEEDS)
    ]
    return llm.chat([CONVERSATION] * NUM_SEEDS, params, tool_use=tool_use)


def test_required_returns_the_sampled_calls_of_tools_whose_schemas_use_defs(llm: LLM) -> None:
    tools = {tool.name: tool for tool in (FORECAST, TIME)}
    for completion in sampled(llm, ToolUse(tuple(tools.values()), "required")):
        assert completion.finish_reason == "stop", completion.text
        calls = json.loads(completion.text)
        assert [(c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [
            (call["name"], call["arguments"]) for call in calls
        ]
        for call in completion.tool_calls:
            jsonschema.validate(json.loads(call.arguments), tools[call.name].schema)


def test_a_named_function_without_parameters_returns_an_object_of_arguments(llm: LLM) -> None:
    for completion in sampled(llm, ToolUse((FORECAST, TIME), "get_time")):
        assert completion.finish_reason == "stop", completion.text
        arguments = json.loads(completion.text)
        assert isinstance(arguments, dict), completion.text
        assert [(c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [("get_time", arguments)]


BAD_PARAMETERS = json.dumps({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}})
BAD_PARAMETERS_MESSAGE = (
    "tools.parameters: 'f' has 'uniqueItems' at #/properties/a, a keyword the grammar cannot enforce; "
    "leave it out"
)


@pytest.mark.parametrize(
    "tool_choice",
    [
        None,
        pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_AUTO),
        pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE),
        pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
        pb.ToolChoice(function_name="f"),
    ],
    ids=["unset", "auto", "none", "required", "named"],
)
def test_a_tool_schema_the_grammar_cannot_enforce_is_invalid_argument_whatever_the_tool_choice(
    stub, tool_choice
) -> None:
    messages = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="hi")],
        tools=[pb.Tool(name="f", parameters=BAD_PARAMETERS)],
        tool_choice=tool_choice,
    )
    request = pb.GenerateRequest(messages=messages, sampling_params=pb.SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as generate:
        list(stub.Generate(request, timeout=60))
    with pytest.raises(grpc.RpcError) as tokenize:
        stub.Tokenize(pb.TokenizeRequest(messages=messages), timeout=60)
    for info in (generate, tokenize):
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            BAD_PARAMETERS_MESSAGE,
        )
