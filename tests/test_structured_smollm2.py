"""Structured output on the embedded SmolLM2-135M-Instruct (byte-level BPE, 49152 tokens)."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import xgrammar as xgr

from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.default_model import default_model_path
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.tokenizer_info import build_tokenizer_info
from sluice.engine.structured.tool_calls import Tool, ToolUse

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = Tool(
    "get_weather",
    "Get the current weather in a city",
    json.dumps(
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
    ),
)
CLOCK = Tool(
    "get_time",
    "Get the current time in a timezone",
    json.dumps(
        {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        }
    ),
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def test_the_vocabulary_given_to_xgrammar_decodes_as_transformers_tokenizer_does(llm: LLM) -> None:
    from transformers import AutoTokenizer

    directory, name = os.path.split(default_model_path())
    hf = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    vocab_size = llm.engine.model_info.vocab_size
    ours = build_tokenizer_info(llm.tokenizer, vocab_size, llm.engine.eos_token_ids)
    reference = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    assert (ours.vocab_type, ours.add_prefix_space) == (xgr.VocabType.BYTE_LEVEL, False)
    assert (reference.vocab_type, reference.add_prefix_space) == (ours.vocab_type, ours.add_prefix_space)
    # Special and stop tokens never match grammar text (<|im_end|> is only allowed once the grammar is done).
    special = set(ours.special_token_ids) | set(ours.stop_token_ids)
    assert hf.eos_token_id in ours.stop_token_ids
    assert {hf.convert_tokens_to_ids(t) for t in hf.all_special_tokens} <= special
    decoded, expected = list(ours.decoded_vocab), list(reference.decoded_vocab)
    assert len(decoded) == len(expected) == vocab_size
    assert [i for i in range(vocab_size) if i not in special and decoded[i] != expected[i]] == []
    assert decoded[hf.convert_tokens_to_ids("Ġworld")] == b" world"


def test_extraction_with_a_schema_returns_values_from_the_text(llm: LLM) -> None:
    text = "Maria Lopez is a 34 year old engineer from Madrid."
    conversation = [{"role": "user", "content": f"Extract the name and age as JSON from: {text}"}]
    params = SamplingParams(
        temperature=0.0, max_tokens=60, constraint=Constraint(json_schema=json.dumps(PERSON))
    )
    [completion] = llm.chat([conversation], params)
    value = json.loads(completion.text)
    jsonschema.validate(value, PERSON)
    assert value["name"] in text and value["name"].strip()
    assert re.search(rf"\b{value['age']}\b", text)


def test_required_tool_choice_returns_a_parsable_call_of_one_of_the_tools(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    params = SamplingParams(temperature=0.0, max_tokens=80)
    [completion] = llm.chat([conversation], params, tool_use=ToolUse((WEATHER, CLOCK), "required"))
    assert completion.finish_reason == "stop"
    assert completion.tool_calls, completion.text
    for call in completion.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]
        jsonschema.validate(json.loads(call.arguments), json.loads(tool.parameters))
