"""Auto tool choice: a <tool_call> block that is not JSON of calls of the tools (arguments that are not
JSON, an unknown tool, a list with one such call) gives no call and stays in the content, as the model
wrote it; the blocks that parse become calls and leave the content."""

from __future__ import annotations

import json

from sluice.engine.structured.tool_calls import Tool, ToolUse

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
AUTO = ToolUse(
    (Tool("get_weather", "Weather in a city", json.dumps(CITY)), Tool("get_time", "The time")), "auto"
)
GOOD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
BAD_BLOCKS = [
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": Europe/Rome}}\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>',  # no such tool
    '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n[{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]\n</tool_call>',
]


def test_a_block_that_gives_no_call_stays_in_the_content() -> None:
    for bad in BAD_BLOCKS:
        text = f"Checking.\n{GOOD}\n{bad}\nDone."
        calls = AUTO.parse(text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
        assert AUTO.content(text) == f"Checking.\n\n{bad}\nDone."


def test_every_block_that_parses_leaves_the_content() -> None:
    calls = '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]'
    two = f"<tool_call>\n{calls}\n</tool_call>"
    text = f"{GOOD}\n{two}"
    assert [c.name for c in AUTO.parse(text)] == ["get_weather", "get_time", "get_time"]
    assert AUTO.content(text) == ""


def test_an_output_that_is_calls_gives_them_all_or_none() -> None:
    """Without <tool_call> blocks the whole output is the JSON of the calls, or it is text."""
    good = '{"name": "get_time", "arguments": {}}'
    assert [c.name for c in AUTO.parse(f"[{good}, {good}]")] == ["get_time", "get_time"]
    assert AUTO.parse(f'[{good}, {{"name": "nope", "arguments": {{}}}}]') == ()
    assert AUTO.parse(f'[{good}, {{"name": "get_time", "arguments": "{{}}"}}]') == ()


def test_mistral_and_llama_outputs_give_their_calls_after_their_markers() -> None:
    """Auto keeps special tokens in the text, so Mistral's [TOOL_CALLS] and Llama 3.1's <|python_tag|>
    stayed before the JSON, which then did not parse: every such call came back as text. Split as vLLM's
    mistral (v3/v7 JSON list, v11 name[ARGS]{...}) and llama3_json (calls apart by ';') parsers split."""
    rome = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    outputs = {
        f"[TOOL_CALLS] [{rome}]": ["get_weather"],
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}': [
            "get_weather",
            "get_time",
        ],
        f'<|python_tag|>{rome}; {{"name": "get_time", "parameters": {{}}}}': ["get_weather", "get_time"],
        '{"name": "get_weather", "parameters": {"city": "a; b"}}': ["get_weather"],  # ';' inside a string
    }
    for text, names in outputs.items():
        assert [c.name for c in AUTO.parse(text)] == names, text
        assert AUTO.content(text) == ""
    assert json.loads(AUTO.parse(f"[TOOL_CALLS] [{rome}]")[0].arguments) == {"city": "Rome"}
    for text in (f"Sure. [TOOL_CALLS] [{rome}]", f"{rome} and more", f"{rome};", "[TOOL_CALLS]nope[ARGS]{}"):
        assert AUTO.parse(text) == (), text  # text, as the model wrote it
