"""Auto tool choice with a tokenizer whose <tool_call> and </tool_call> are special tokens (Hermes-style
checkpoints): the request's text keeps them (vLLM's Hermes parser turns skip_special_tokens off for such a
request), so the calls and the content beside them parse from what the model wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_fixtures import build_byte_level_bpe
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from sluice.engine.frontend.output_processor import OutputProcessor
from sluice.engine.messages import AddRequest, CoreOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.tool_calls import Tool, ToolUse
from sluice.engine.text.tokenizer import Tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = (Tool("get_weather", "Weather in a city", json.dumps(CITY)), Tool("get_time", "The time now"))
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
TIME_CALL = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = build_byte_level_bpe(tmp_path_factory.mktemp("bpe_tool_tags"))
    backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
    backend.add_special_tokens(
        [AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)]
    )
    backend.save(str(directory / "tokenizer.json"))
    return Tokenizer.from_pretrained(str(Path(directory)))


def finished_output(tokenizer: Tokenizer, tool_use: ToolUse, text: str, params: SamplingParams):
    """The last output of a request whose model wrote `text` (then reached max_tokens)."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor.add_request(AddRequest("r", [1, 2, 3], tool_use.sampling_params(params), 0.0), tool_use)
    core_output = CoreOutput("r", token_ids, None, 0, 0, None, None, finish_reason="length")
    (output,) = processor.process([core_output]).outputs
    return output


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_auto_parses_calls_between_special_tags(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    tag = tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert len(tag) == 1 and tokenizer.decode(tag, skip_special_tokens=True) == ""  # a special token
    params = SamplingParams(max_tokens=200, skip_special_tokens=skip_special_tokens)
    output = finished_output(tokenizer, ToolUse(TOOLS, "auto"), f"Let me check.\n{CALL}\n{TIME_CALL}", params)
    assert output.text == f"Let me check.\n{CALL}\n{TIME_CALL}"
    calls = [(call.name, json.loads(call.arguments)) for call in output.tool_calls]
    assert calls == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert output.content == "Let me check."


def test_other_modes_keep_skipping_special_tokens(tokenizer: Tokenizer) -> None:
    """A required or named call, or auto under a constraint of the request's own, is held to a grammar,
    which never allows a special token; none parses nothing."""
    params = SamplingParams(max_tokens=200)
    for mode in ("none", "required", "get_time"):
        assert ToolUse(TOOLS, mode).sampling_params(params).skip_special_tokens
    constrained = SamplingParams(max_tokens=200, constraint=Constraint(regex="[a-z]+"))
    assert ToolUse(TOOLS, "auto").sampling_params(constrained).skip_special_tokens
    output = finished_output(tokenizer, ToolUse(TOOLS, "none"), f"Let me check.\n{CALL}", params)
    assert output.text == 'Let me check.\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert output.tool_calls == ()
