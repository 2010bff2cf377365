"""Without a reasoning parser (the default) a chat's output is as before: the whole text, no reasoning_text,
and tool calls parsed from all of it."""

from __future__ import annotations

import json
import re

import pytest

from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(120)

CALL_IN_THOUGHT = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [
    pb.Tool(
        name="get_weather",
        parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}),
    ),
    pb.Tool(name="get_time", parameters=""),
]


def forced_chat(output: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=200, regex=re.escape(output), temperature=0.0)
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather?")], tools=TOOLS)
    return pb.GenerateRequest(messages=messages, sampling_params=sampling)


def test_without_the_parser_the_think_block_stays_in_the_text(stub) -> None:
    output = f"<think>maybe {CALL_IN_THOUGHT}</think>Let me look.{CALL}"
    chunks = list(stub.Generate(forced_chat(output), timeout=60))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
    assert "".join(c.text for c in chunks) == output
    assert all(c.reasoning_text == "" for c in chunks)
    assert [c.name for c in chunks[-1].tool_calls] == ["get_time", "get_weather"]
