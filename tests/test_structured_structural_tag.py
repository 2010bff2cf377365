"""Structural tags (vLLM's `structural_tag`): free text in which a trigger starts a tagged structure (the
older form: begin, JSON schema, end), or xgrammar's `format` (here one tag the whole output is). The compiled
grammar accepts what the tag allows and refuses the rest; the embedded SmolLM2 answers inside the tag with
JSON its schema validates; a malformed tag, or a schema keyword the grammar cannot enforce, is
INVALID_ARGUMENT naming where it is."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
import xgrammar as xgr
from service_harness import PATIENCE_S
from test_grammar_compiler import grammar_compiler

from sluice import generate_request
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
OLDER = {
    "type": "structural_tag",
    "structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}],
    "triggers": ["<function="],
}
WHOLE = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<weather>",
        "content": {"type": "json_schema", "json_schema": CITY},
        "end": "</weather>",
    },
}


NOT_A_TAG = 'structural_tag: must be a JSON object whose "type", if given, is "structural_tag"'


def _accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


def test_the_compiled_grammar_is_the_tags(llama_dir: str) -> None:
    compiler = grammar_compiler(llama_dir, num_workers=1)
    try:
        older = compiler.submit(Constraint(structural_tag=json.dumps(OLDER))).result(timeout=PATIENCE_S)
        whole = compiler.submit(Constraint(structural_tag=WHOLE)).result(timeout=PATIENCE_S)
    finally:
        compiler.shutdown()
    assert _accepts(older, "no call at all")
    assert _accepts(older, 'Let me see. <function=get_weather>{"city": "Paris"}</function> done')
    assert not _accepts(older, 'x <function=get_weather>{"town": "Paris"}</function>')  # not the schema
    assert not _accepts(older, 'x <function=get_weather>{"city": "Paris"} and more')  # no end
    assert _accepts(whole, '<weather>{"city": "Rome"}</weather>')
    assert not _accepts(whole, 'Sure: <weather>{"city": "Rome"}</weather>')
    assert not _accepts(whole, '<weather>{"city": "Rome", "x": 1}</weather>')


def test_a_backslash_is_a_json_escape_in_the_tags_schema_and_itself_in_its_regex(llama_dir: str) -> None:
    """A schema's pattern matches the JSON text of a string, where one backslash is written as two; a
    regex format's pattern matches the text itself."""
    path = {
        "type": "object",
        "properties": {"p": {"type": "string", "pattern": r"^C:\\[a-z]+$"}},
        "required": ["p"],
    }
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {
                    "type": "tag",
                    "begin": "<json>",
                    "content": {"type": "json_schema", "json_schema": path},
                    "end": "</json>",
                },
                {
                    "type": "tag",
                    "begin": "<text>",
                    "content": {"type": "regex", "pattern": r"C:\\[a-z]+"},
                    "end": "</text>",
                },
            ],
        },
    }
    compiler = grammar_compiler(llama_dir, num_workers=1)
    try:
        compiled = compiler.submit(Constraint(structural_tag=tag)).result(timeout=PATIENCE_S)
    finally:
        compiler.shutdown()
    assert _accepts(compiled, '<json>{"p": "C:\\\\ab"}</json><text>C:\\ab</text>')
    assert not _accepts(compiled, '<json>{"p": "C:\\ab"}</json><text>C:\\ab</text>')
    assert not _accepts(compiled, '<json>{"p": "C:\\\\ab"}</json><text>C:\\\\ab</text>')


def test_smollm2_answers_inside_the_tag_with_json_of_its_schema() -> None:
    conversation = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    params = SamplingParams(temperature=0.0, max_tokens=60, constraint=Constraint(structural_tag=WHOLE))
    [completion] = LLM().chat([conversation], params)
    assert completion.finish_reason == "stop", completion.text
    text = completion.text
    assert text.startswith("<weather>") and text.endswith("</weather>"), text
    jsonschema.validate(json.loads(text.removeprefix("<weather>").removesuffix("</weather>")), CITY)


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("{", "structural_tag: is not valid JSON"),
        ({"type": "tag"}, NOT_A_TAG),
        ("[]", NOT_A_TAG),
        ({**OLDER, "triggers": []}, "structural_tag.triggers: must be a non-empty list"),
        ({**OLDER, "structures": []}, "structural_tag.structures: must be a non-empty list"),
        (
            {**OLDER, "structures": ["<f>"]},
            "structural_tag.structures[0]: must be an object with begin, schema, end",
        ),
        (
            {**OLDER, "structures": [{"begin": "<f>", "schema": CITY, "end": None}]},
            "structural_tag.structures[0]: begin and end must be strings",
        ),
        (
            {**OLDER, "structures": [{"begin": "<f>", "schema": "city", "end": "</f>"}]},
            "structural_tag.structures[0].schema: must be a JSON schema object",
        ),
        (
            {**OLDER, "structures": [{"begin": "<f>", "schema": {"not": {"type": "null"}}, "end": "</f>"}]},
            "structural_tag.structures[0].schema: 'not' at # is a keyword the grammar cannot enforce",
        ),
        (
            {
                "type": "structural_tag",
                "format": {
                    **WHOLE["format"],
                    "content": {"type": "json_schema", "json_schema": {"type": "string", "if": {}}},
                },
            },
            "structural_tag.format.content.json_schema: 'if' at # is a keyword the grammar cannot enforce",
        ),
        (
            {
                "type": "structural_tag",
                "format": {**WHOLE["format"], "content": {"type": "regex", "pattern": "a$b"}},
            },
            "structural_tag.format.content.pattern: the pattern has the anchor '$' at position 1, which "
            "xgrammar drops",
        ),
        (
            {"type": "structural_tag", "format": {"type": "no such format"}},
            "structural_tag: does not compile",
        ),
    ],
)
def test_a_bad_tag_is_invalid_argument_naming_where(stub, tag: object, message: str) -> None:
    request = generate_request("hi", max_tokens=4)
    request.sampling_params.structural_tag = tag if isinstance(tag, str) else json.dumps(tag)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=PATIENCE_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message), info.value.details()
