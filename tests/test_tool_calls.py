"""Tool use: what the chat template receives, the constraint per tool_choice, and parsing finished outputs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr
from tool_schemas import forecast_tool

from sluice.engine.errors import InvalidRequestError
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.tool_calls import Tool, ToolUse

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = Tool("get_weather", "Weather in a city", json.dumps(CITY))
TIME = Tool("get_time", "The time now")
FORECAST = forecast_tool(city_max_length=12)
# A tree: "#" refers to the tool's own schema.
TREE = {
    "type": "object",
    "properties": {"label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["label"],
}
OUTLINE = Tool("outline", "An outline", json.dumps(TREE))


def parsed(tool_use: ToolUse, text: str) -> tuple[tuple[str, str], ...]:
    """The calls in `text` as (name, arguments); each has an id of 9 letters and digits, its own."""
    calls = tool_use.parse(text)
    assert all(re.fullmatch("[A-Za-z0-9]{9}", call.id) for call in calls), calls
    assert len({call.id for call in calls}) == len(calls), calls
    return tuple((call.name, call.arguments) for call in calls)


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


def test_required_accepts_exactly_the_calls_of_tools_that_reference_their_own_definitions() -> None:
    tools = (FORECAST, OUTLINE, WEATHER)
    text = ToolUse(tools, "required").constraint().json_schema
    xgr.Grammar.from_json_schema(text, any_whitespace=False)  # compiles: each "$ref" still resolves
    schema = json.loads(text)
    place = {"city": "Oslo", "unit": "C"}
    arguments = [
        {"place": place, "days": 3},
        {"place": {**place, "unit": "K"}, "days": 3},
        {"place": place, "days": 8},
        {"place": {"city": "Oslo"}, "days": 3},
        {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]},
        {"label": "a", "children": [{"label": "b", "children": [{"title": "c"}]}]},
        {"label": "a", "children": [{"label": 1}]},
        {"city": "Rome"},
    ]
    calls = [[{"name": tool.name, "arguments": args}] for tool in tools for args in arguments]
    accepted = [call for call in calls if jsonschema.Draft202012Validator(schema).is_valid(call)]
    # The reference: jsonschema validating the arguments against the tool's own schema.
    reference = [
        [{"name": tool.name, "arguments": args}]
        for tool in tools
        for args in arguments
        if jsonschema.Draft202012Validator(tool.schema).is_valid(args)
    ]
    assert accepted == reference
    assert len(reference) == 3  # one valid call of each tool


def test_parameters_without_a_type_describe_an_object_and_empty_ones_no_arguments() -> None:
    for parameters, schema in [
        ("{}", {"type": "object"}),
        (
            '{"properties": {"n": {"type": "integer"}}}',
            {"type": "object", "properties": {"n": {"type": "integer"}}},
        ),
        ("", {"type": "object", "properties": {}}),
    ]:
        tool = Tool("f", parameters=parameters)
        assert tool.for_template()["function"]["parameters"] == schema
        named = json.loads(ToolUse((tool,), "f").constraint().json_schema)
        required = json.loads(ToolUse((tool,), "required").constraint().json_schema)
        jsonschema.validate({}, named)
        jsonschema.validate([{"name": "f", "arguments": {}}], required)
        for value in (4219990, "rich", None, []):
            assert not jsonschema.Draft202012Validator(named).is_valid(value)
            assert not jsonschema.Draft202012Validator(required).is_valid([{"name": "f", "arguments": value}])


def test_a_named_function_constrains_to_its_arguments_and_none_auto_do_not() -> None:
    assert ToolUse((WEATHER, TIME), "get_weather").constraint() == Constraint(
        json_schema=json.dumps(CITY), origin="tools.parameters"
    )
    assert ToolUse((WEATHER,), "auto").constraint() is None
    assert ToolUse((WEATHER,), "none").constraint() is None


def test_parsing_per_tool_choice() -> None:
    tools = (WEATHER, TIME)
    required = (
        '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    )
    assert parsed(ToolUse(tools, "required"), required) == (
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", "{}"),
    )
    assert parsed(ToolUse(tools, "get_weather"), '{"city": "Lima"}') == (("get_weather", '{"city": "Lima"}'),)
    auto = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert parsed(ToolUse(tools, "auto"), auto) == (("get_weather", '{"city": "Rome"}'),)
    assert parsed(ToolUse(tools, "auto"), '{"name": "get_time", "parameters": {}}') == (("get_time", "{}"),)
    assert parsed(ToolUse(tools, "auto"), "It is sunny.") == ()
    assert parsed(ToolUse(tools, "auto"), '{"name": "unknown", "arguments": {}}') == ()
    assert parsed(ToolUse(tools, "none"), required) == ()


def test_a_named_call_of_a_tool_spelled_like_a_mode_calls_that_tool() -> None:
    """`named` (the proto's function_name) reads tool_choice as a tool's name: a tool called "none" was
    taken for the mode, unconstrained and parsed as no call."""
    called_none = Tool("none", "A tool with an unlucky name", json.dumps(CITY))
    tool_use = ToolUse((WEATHER, called_none), "none", named=True)
    assert tool_use.mode == "function"
    assert tool_use.constraint() == Constraint(json_schema=json.dumps(CITY), origin="tools.parameters")
    assert parsed(tool_use, '{"city": "Oslo"}') == (("none", '{"city": "Oslo"}'),)
    assert ToolUse((WEATHER, called_none), "none").mode == "none"
    with pytest.raises(ValueError) as info:
        ToolUse((WEATHER,), "auto", named=True)
    assert str(info.value) == "tool_choice.function_name: 'auto' is not one of the tools ['get_weather']"


def test_the_content_beside_the_calls_is_autos_text_outside_its_blocks() -> None:
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    auto = ToolUse((WEATHER, TIME), "auto")
    assert (
        auto.content(f"Let me check.\n{block}\nThen the time.\n{block}") == "Let me check.\n\nThen the time."
    )
    assert auto.content(block) == ""
    assert auto.content('{"name": "get_time", "arguments": {}}') == ""  # a whole-output call
    required = '[{"name": "get_time", "arguments": {}}]'
    assert ToolUse((WEATHER, TIME), "required").content(required) == ""
    assert ToolUse((WEATHER, TIME), "get_weather").content('{"city": "Oslo"}') == ""


@pytest.mark.parametrize("marker", ["<|python_tag|>", "[TOOL_CALLS]", "<tool_call>", "</tool_call>"])
def test_a_marker_inside_an_arguments_string_is_its_text(marker: str) -> None:
    """A required call's array (or a whole-output call under auto) was split at a Mistral or Llama marker,
    or cut at a <tool_call> tag, inside one of its strings: no call parsed from a valid output."""
    arguments = json.dumps({"city": f"see {marker} here"})
    required = f'[{{"name": "get_weather", "arguments": {arguments}}}]'
    assert parsed(ToolUse((WEATHER, TIME), "required"), required) == (("get_weather", arguments),)
    auto = ToolUse((WEATHER, TIME), "auto")
    whole = f'{{"name": "get_weather", "arguments": {arguments}}}'
    assert parsed(auto, whole) == (("get_weather", arguments),)
    assert auto.content(whole) == ""


def test_each_parse_gives_its_calls_new_ids() -> None:
    required = ToolUse((WEATHER, TIME), "required")
    text = '[{"name": "get_time", "arguments": {}}]'
    assert len({call.id for _ in range(20) for call in required.parse(text)}) == 20


def test_auto_parses_a_last_block_the_output_did_not_close() -> None:
    # A stop string "</tool_call>" or EOS right after the JSON leaves the last block unclosed.
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
    last = '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    assert parsed(ToolUse((WEATHER, TIME), "auto"), first + last) == (
        ("get_weather", '{"city": "Rome"}'),
        ("get_time", "{}"),
    )
    assert parsed(ToolUse((WEATHER, TIME), "auto"), last) == (("get_time", "{}"),)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_calls_whose_arguments_are_not_json_numbers_are_dropped(number) -> None:
    good = '{"name": "get_time", "arguments": {}}'
    bad = f'{{"name": "get_weather", "arguments": {{"city": "Oslo", "days": {number}}}}}'
    auto = ToolUse((WEATHER, TIME), "auto")
    assert parsed(auto, f"<tool_call>{bad}</tool_call><tool_call>{good}</tool_call>") == (("get_time", "{}"),)
    assert parsed(auto, bad) == ()
    assert parsed(ToolUse((WEATHER, TIME), "required"), f"[{bad}]") == ()
    assert parsed(ToolUse((WEATHER,), "get_weather"), f'{{"city": {number}}}') == ()


@pytest.mark.parametrize(
    "call",
    [
        '{"name": [], "arguments": {}}',  # a name no tool can have: unhashable, once a TypeError
        '{"name": {"get_time": 1}, "arguments": {}}',
        '{"name": "get_time", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}",  # past json's recursion
        "[" * 5000 + "]" * 5000,
    ],
)
def test_json_that_is_no_call_of_the_tools_is_no_call_whatever_its_shape(call) -> None:
    """Whatever JSON a model writes is parsed without raising: the parser runs in the frontend's reader
    of the engine core's outputs, where an exception would fail every request in flight."""
    auto = ToolUse((WEATHER, TIME), "auto")
    assert parsed(auto, call) == () and parsed(auto, f"<tool_call>{call}</tool_call>") == ()
    assert auto.content(f"Hi <tool_call>{call}</tool_call>") == f"Hi <tool_call>{call}</tool_call>"
    assert parsed(ToolUse((WEATHER, TIME), "required"), f"[{call}]") == ()


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
        (
            lambda: Tool("f", parameters='{"type": "object",}'),
            "tools.parameters: 'f' is not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 19 (char 18)",
        ),
        (lambda: ToolUse((), "none"), "tools: must not be empty when tool_choice is given"),
        (
            lambda: Tool("f", parameters='{"type": "string"}'),
            'tools.parameters: \'f\' must have "type": "object", got "string"',
        ),
        (
            lambda: Tool("f", parameters='{"type": ["object", "null"]}'),
            'tools.parameters: \'f\' must have "type": "object", got ["object", "null"]',
        ),
        (
            lambda: Tool("f", parameters='{"type": "object", "properties": {"a": {"not": {}}}}'),
            "tools.parameters: 'f' has 'not' at #/properties/a, a keyword the grammar cannot enforce; "
            "leave it out",
        ),
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


def test_a_tools_schema_may_be_a_dict_as_openai_clients_send_it() -> None:
    """A dict failed in json.loads with a bare TypeError naming no field."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    assert Tool("get_weather", parameters=schema) == Tool("get_weather", parameters=json.dumps(schema))
    with pytest.raises(ValueError, match=r"^tools.parameters: 'f' must be a JSON schema \(text or a dict\)$"):
        Tool("f", parameters=["not", "a", "schema"])


def test_a_tool_schema_too_deep_once_wrapped_for_tool_choice_is_refused_naming_tools_parameters() -> None:
    """tool_choice required nests each tool's schema a few levels deeper: a schema the tool took then
    failed as "json_schema: nests too deeply", a field the request never set."""
    for depth in range(250, 3000):
        schema: dict = {"type": "object"}
        for _ in range(depth):
            schema = {"type": "object", "properties": {"a": schema}}
        try:
            tool = Tool("deep", parameters=json.dumps(schema))
        except ValueError:
            break  # the tool itself too deep before its wrapping was: no depth between
        try:
            ToolUse((tool,), "required").constraint()
        except ValueError as exc:
            assert str(exc) == "tools.parameters: nests too deeply"
            return
    pytest.fail(f"no depth the tool takes and its wrapping does not (up to {depth})")
