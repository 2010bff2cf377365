"""Tool use: what the chat template receives, the constraint per tool_choice, and parsing finished outputs."""

from __future__ import annotations

import json

import jsonschema
import pytest

from sluice.engine.errors import InvalidRequestError
from sluice.engine.outputs import ToolCall
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.tool_calls import Tool, ToolUse

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = Tool("get_weather", "Weather in a city", json.dumps(CITY))
TIME = Tool("get_time", "The time now")


def test_tools_reach_the_template_in_transformers_json_schema_form() -> None:
    assert ToolUse((WEATHER, TIME)).for_template() == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
        },
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": "The time now",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    ]


def test_required_accepts_exactly_arrays_of_calls_of_the_tools() -> None:
    schema = json.loads(ToolUse((WEATHER, TIME), "required").constraint().json_schema)
    jsonschema.validate(
        [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}],
        schema,
    )
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_a_named_function_constrains_to_its_arguments_and_none_auto_do_not() -> None:
    assert ToolUse((WEATHER, TIME), "get_weather").constraint() == Constraint(json_schema=json.dumps(CITY))
    assert ToolUse((WEATHER,), "auto").constraint() is None
    assert ToolUse((WEATHER,), "none").constraint() is None


def test_parsing_per_tool_choice() -> None:
    tools = (WEATHER, TIME)
    required = (
        '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    )
    assert ToolUse(tools, "required").parse(required) == (
        ToolCall("get_weather", '{"city": "Oslo"}'),
        ToolCall("get_time", "{}"),
    )
    assert ToolUse(tools, "get_weather").parse('{"city": "Lima"}') == (
        ToolCall("get_weather", '{"city": "Lima"}'),
    )
    auto = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert ToolUse(tools, "auto").parse(auto) == (ToolCall("get_weather", '{"city": "Rome"}'),)
    assert ToolUse(tools, "auto").parse('{"name": "get_time", "parameters": {}}') == (
        ToolCall("get_time", "{}"),
    )
    assert ToolUse(tools, "auto").parse("It is sunny.") == ()
    assert ToolUse(tools, "auto").parse('{"name": "unknown", "arguments": {}}') == ()
    assert ToolUse(tools, "none").parse(required) == ()


def test_a_required_call_cannot_be_combined_with_another_constraint() -> None:
    params = SamplingParams(constraint=Constraint(regex="a"))
    with pytest.raises(InvalidRequestError) as info:
        ToolUse((WEATHER,), "required").sampling_params(params)
    assert str(info.value) == "tool_choice: 'required' cannot be combined with a constraint"
    assert ToolUse((WEATHER,), "auto").sampling_params(params) is params


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Tool(""), "tools.name: must not be empty"),
        (lambda: Tool("f", parameters="[1]"), "tools.parameters: 'f' must be a JSON object"),
        (lambda: ToolUse((WEATHER, WEATHER)), "tools: names must be unique"),
        (
            lambda: ToolUse((WEATHER,), "other"),
            "tool_choice: 'other' is not a mode nor one of the tools ['get_weather']",
        ),
    ],
)
def test_bad_tools_name_the_field(make, message) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message
