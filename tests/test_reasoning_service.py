"""The reasoning parser over real gRPC: a tiny random-weight Llama whose output a regex forces, behind a
server run with reasoning_parser="deepseek_r1" (and the offline LLM's chat with it)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from service_harness import ServerThread, tiny_engine_config

from sluice import Client
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(180)

CALL_IN_THOUGHT = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = pb.Tool(
    name="get_weather",
    description="Current weather in a city",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}),
)
TIME = pb.Tool(name="get_time", description="The time now", parameters="")


@pytest.fixture(scope="module")
def server(llama_dir: str):
    config = tiny_engine_config(llama_dir)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, reasoning_parser="deepseek_r1")
    )
    thread = ServerThread(config).start()
    yield thread
    thread.stop()


def forced(output: str, *, chat: bool = True, tools: tuple[pb.Tool, ...] = ()) -> pb.GenerateRequest:
    """A request whose output is `output` (the regex allows nothing else), then EOS."""
    sampling = pb.SamplingParams(max_tokens=200, regex=re.escape(output), temperature=0.0)
    if not chat:
        return pb.GenerateRequest(text="hello there", sampling_params=sampling)
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather?")], tools=tools)
    return pb.GenerateRequest(messages=messages, sampling_params=sampling)


def parts(chunks: list[pb.GenerateResponse]) -> tuple[str, str]:
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
    return "".join(c.reasoning_text for c in chunks), "".join(c.text for c in chunks)


@pytest.mark.parametrize("output", ["<think>abc def</think>the answer", "abc def</think>the answer"])
def test_a_chats_reasoning_streams_apart_from_its_answer(stub, output: str) -> None:
    chunks = list(stub.Generate(forced(output), timeout=60))
    assert parts(chunks) == ("abc def", "the answer")


def test_an_output_cut_while_thinking_is_all_reasoning(stub) -> None:
    request = forced("<think>still thinking about it</think>done")
    request.sampling_params.max_tokens = 4
    chunks = list(stub.Generate(request, timeout=60))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert "".join(c.text for c in chunks) == ""
    assert "".join(c.reasoning_text for c in chunks)


def test_a_plain_prompts_output_is_left_whole(stub) -> None:
    chunks = list(stub.Generate(forced("<think>abc</think>answer", chat=False), timeout=60))
    assert parts(chunks) == ("", "<think>abc</think>answer")


def test_a_tool_call_inside_the_thinking_is_no_call(stub, server) -> None:
    output = f"<think>maybe {CALL_IN_THOUGHT}</think>Let me look.{CALL}"
    request = forced(output, tools=(WEATHER, TIME))
    chunks = list(stub.Generate(request, timeout=60))
    assert parts(chunks) == (f"maybe {CALL_IN_THOUGHT}", f"Let me look.{CALL}")
    calls = chunks[-1].tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert chunks[-1].content == "Let me look."
    with Client(server.target) as client:
        completion = client.complete(request, timeout=60)
    assert (completion.reasoning, completion.text) == parts(chunks)
    assert completion.as_message()["reasoning_content"] == f"maybe {CALL_IN_THOUGHT}"
    assert [c["name"] for c in completion.as_message()["tool_calls"]] == ["get_weather"]


def test_the_offline_llm_chat_collects_the_reasoning(llama_dir: str) -> None:
    llm = LLM(llama_dir, reasoning_parser="deepseek_r1", num_blocks=64, attention_backend="torch")
    params = SamplingParams(
        max_tokens=60, temperature=0.0, constraint=Constraint(regex=r"<think>ab</think>cd")
    )
    (chat,) = llm.chat([{"role": "user", "content": "hi"}], params)
    (plain,) = llm.generate("hi", params)
    assert (chat.reasoning, chat.text) == ("ab", "cd")
    assert chat.as_message() == {"role": "assistant", "content": "cd", "reasoning_content": "ab"}
    assert (plain.reasoning, plain.text) == ("", "<think>ab</think>cd")


@pytest.mark.parametrize(
    ("tool_choice", "output"),
    [
        (pb.ToolChoice(function_name="get_time"), "{}"),
        (pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), '[{"name": "get_time", "arguments": {}}]'),
    ],
    ids=["named", "required"],
)
def test_a_forced_tool_call_is_content_with_the_parser_on(stub, tool_choice, output) -> None:
    """Over a vocabulary without a `</think>` token (the tiny Llama's), a required or named call's grammar
    applies from the first token (no think block): its output is content, and the call is returned, as
    without the parser."""
    request = pb.GenerateRequest(
        request_id="forced-call",
        messages=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content="time?")], tools=[TIME], tool_choice=tool_choice
        ),
        sampling_params=pb.SamplingParams(max_tokens=60, temperature=0.0),
    )
    chunks = list(stub.Generate(request, timeout=60))
    assert [c.name for c in chunks[-1].tool_calls] == ["get_time"]
    assert parts(chunks) == ("", output)


def test_a_json_answer_is_content_with_the_parser_on(stub) -> None:
    request = forced("x")
    request.sampling_params.ClearField("regex")
    request.sampling_params.json_schema = json.dumps({"type": "object", "properties": {}, "maxProperties": 0})
    chunks = list(stub.Generate(request, timeout=60))
    assert parts(chunks) == ("", "{}")
