"""JSON schemas whose keywords xgrammar compiles without enforcing them where they stand: a keyword beside
the one xgrammar reads ($ref, const, enum, anyOf, oneOf, allOf), string and number keywords of a schema
without a type, `multipleOf` of numbers, length limits beside a pattern or a format, a remote $ref, a
required name without a property. Each is refused when the Constraint is built (the field and the
keyword's place named); every schema that is accepted compiles to a grammar that holds the output to it,
as `jsonschema` (the reference) judges it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr
from referencing import Registry, Resource
from service_harness import PATIENCE_S

from sluice.engine.structured.constraint import Constraint, unenforced_keyword
from sluice.engine.structured.grammar_compiler import GrammarCompiler
from sluice.engine.structured.tool_calls import Tool

# (schema, an output the schema refuses, the keyword refused, its place). Each output was matched by the
# grammar xgrammar compiled from the schema, so the constraint would have "guaranteed" an invalid output.
IGNORED = [
    ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf", "#"),
    ({"type": "integer", "multipleOf": 1.5}, "2", "multipleOf", "#"),
    ({"type": ["number", "null"], "multipleOf": 2}, "3", "multipleOf", "#"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, '"a"', "minLength", "#"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, '"aaaaa"', "maxLength", "#"),
    ({"type": "string", "format": "email", "maxLength": 3}, '"a@b.co"', "maxLength", "#"),
    ({"type": "string", "format": "email", "pattern": "^a+$"}, '"b@c.de"', "pattern", "#"),
    ({"$ref": "http://example.com/integer.json"}, '"anything"', "$ref", "#"),
    ({"type": "string", "enum": ["a", 1]}, "1", "type", "#"),
    ({"type": "integer", "const": "x"}, '"x"', "type", "#"),
    ({"type": "integer", "enum": [1, 2], "minimum": 2}, "1", "minimum", "#"),
    ({"type": "integer", "oneOf": [{"minimum": 1}, {"maximum": -1}]}, "0", "minimum", "#/oneOf/0"),
    ({"allOf": [{"type": "integer"}], "maximum": 3}, "5", "maximum", "#"),
    (
        {"type": "object", "properties": {"n": {"$ref": "#/$defs/i", "maximum": 3}}, "required": ["n"],
         "$defs": {"i": {"type": "integer"}}},
        '{"n": 5}',
        "maximum",
        "#/properties/n",
    ),
    ({"type": "array", "items": {"minLength": 3}}, '["a"]', "minLength", "#/items"),
    ({"type": "array", "items": {"minimum": 3}}, "[1]", "minimum", "#/items"),
    ({"format": "email"}, '"not an email"', "format", "#"),
    (
        {"type": "object", "propertyNames": {"minLength": 3, "pattern": "^a+$"}},
        '{"a": 1}',
        "minLength",
        "#/propertyNames",
    ),
    (
        {"type": "object", "required": ["zz"], "additionalProperties": {"type": "integer"}},
        "{}",
        "required",
        "#",
    ),
    # A structured-output fuzz found these (a review, unevaluatedProperties): xgrammar holds only additional
    # keys' names to propertyNames (and writes them past a closed object's end), and a listed property
    # that a pattern also names may take the pattern's schema alone.
    (
        {"type": "object", "properties": {"abc": {"type": "integer"}}, "propertyNames": {"maxLength": 1}},
        '{"abc": 1}',
        "propertyNames",
        "#",
    ),
    (
        {"type": "object", "properties": {}, "additionalProperties": False,
         "propertyNames": {"pattern": "^[a-c]+$"}},
        '{"aa": 0}',
        "propertyNames",
        "#",
    ),
    (
        {"type": "object", "unevaluatedProperties": False, "propertyNames": {"pattern": "^[a-c]+$"}},
        '{"aa": 0}',
        "propertyNames",
        "#",
    ),
    (
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5}},
         "patternProperties": {"^[a-z]+$": {"type": "integer"}}, "additionalProperties": False},
        '{"a": 1}',
        "patternProperties",
        "#",
    ),
    # JSON Schema's pattern matches anywhere in a name: "x" names "max" (its value must be an integer).
    (
        {"type": "object", "properties": {"max": {}}, "patternProperties": {"x": {"type": "integer"}}},
        '{"max": "s"}',
        "patternProperties",
        "#",
    ),
    # Assertions xgrammar drops inside a schema's regexes: a lookahead, an anchor inside a group.
    ({"type": "string", "pattern": "^(?!admin$)[a-z]+$"}, '"admin"', "pattern", "#"),
    ({"type": ["string", "null"], "pattern": "^(a$|b)c$"}, '"ac"', "pattern", "#"),
    (
        {"type": "object", "patternProperties": {"^(?!id$)[a-z]+$": {"type": "string"}},
         "additionalProperties": False},
        '{"id": "x"}',
        "patternProperties",
        "#",
    ),
    (
        {"type": "object", "propertyNames": {"pattern": "^(?!x$)[a-z]+$"}},
        '{"x": 1}',
        "pattern",
        "#/propertyNames",
    ),
]  # fmt: skip

# The schema vLLM and SGLang give tool_choice "required" (SMG sends it as json_schema): "type" beside anyOf.
VLLM_REQUIRED_CALLS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "anyOf": [
            {
                "properties": {
                    "name": {"type": "string", "enum": ["f"]},
                    "parameters": {
                        "type": "object",
                        "properties": {"v": {"type": "integer"}},
                        "required": ["v"],
                    },
                },
                "required": ["name", "parameters"],
            }
        ],
    },
}
# (schema, an output it accepts, one it refuses): still accepted, and enforced.
ENFORCED = [
    ({"type": "integer", "multipleOf": 3}, "6", "4"),
    ({"type": ["integer", "null"], "multipleOf": 3}, "null", "4"),
    ({"type": "string", "pattern": "^a+$"}, '"aa"', '"b"'),
    ({"type": "string", "format": "made-up", "maxLength": 3}, '"abc"', '"abcdef"'),
    ({"type": "string", "enum": ["a", "b"]}, '"a"', '"c"'),
    ({"type": ["string", "null"], "const": "x"}, '"x"', '"y"'),
    ({"type": "number", "enum": [1, 2.5]}, "2.5", "2"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "O"}, "null", '"s"'),
    (
        {"$ref": "#/$defs/c", "default": "r", "$defs": {"c": {"enum": ["r", "g"], "type": "string"}}},
        '"g"',
        '"b"',
    ),
    ({"type": "string", "format": "date"}, '"2024-01-31"', '"soon"'),
    ({"format": "made-up"}, "5", "x"),  # an annotation only, as JSON Schema has it
    # A property name is a string: its schema needs no type for its string keywords to hold.
    ({"type": "object", "propertyNames": {"maxLength": 3}}, '{"abc": 1}', '{"abcd": 1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    (VLLM_REQUIRED_CALLS, '[{"name": "f", "parameters": {"v": 1}}]', '[{"name": "f", "parameters": {}}]'),
    # Patterns that name no listed property beside the properties; anchors where xgrammar keeps them.
    (
        {"type": "object", "properties": {"a": {"type": "integer"}},
         "patternProperties": {"^x_[a-z]+$": {"type": "string"}}, "additionalProperties": False},
        '{"a": 1, "x_b": "s"}',
        '{"a": 1, "x_b": 2}',
    ),
    ({"type": "string", "pattern": "^a+$|^b$"}, '"aa"', '"ab"'),
    # A literal quote, backslash or control character: its JSON escape, never the character as it is
    # (`"C:\ab"` does not parse; `"C:\fa"` would parse as "C:", a form feed, "a").
    ({"type": "string", "pattern": r"^C:\\[a-z]+$"}, json.dumps("C:\\ab"), r'"C:\ab"'),
    ({"type": "string", "pattern": r"^\\+$"}, json.dumps("\\\\"), r'"\\\"'),
    ({"type": "string", "pattern": '^"[a-z]"$'}, json.dumps('"a"'), '""a""'),
    ({"type": "string", "pattern": r"^a[\n]b\x09c$"}, json.dumps("a\nb\tc"), '"a\nb\tc"'),
    ({"type": "string", "pattern": r"^[\t\n]+$"}, json.dumps("\t\n"), '"\t\n"'),
    ({"type": "string", "pattern": r'^[\\"]+$'}, json.dumps('"\\'), '"""'),
    ({"type": "string", "pattern": r"^x[\x00-\x1f]$"}, json.dumps("x\x01"), '"x\x01"'),
    # Beside them, a character beyond ASCII stays what it is (written as itself, xgrammar took any ASCII).
    ({"type": "string", "pattern": r'^["\^\u00ff]$'}, '"\u00ff"', '"a"'),
    ({"type": "string", "pattern": r"^[\u00c0-\u00ff0-9\n]+$"}, '"5\u00e9"', '"a"'),
    (
        {"type": "object", "patternProperties": {r"^\\[a-z]$": {"type": "integer"}},
         "additionalProperties": False},
        json.dumps({"\\a": 1}),
        r'{"\a": 1}',
    ),
    ({"type": "string", "pattern": "^\\$[0-9]+$"}, '"$5"', '"5"'),
]  # fmt: skip


# What the remote reference above names, for the reference validator (xgrammar fetches nothing).
REMOTE = Registry().with_resource(
    "http://example.com/integer.json",
    Resource.from_contents({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "integer"}),
)


def validate(value: object, schema: dict) -> None:
    """Raises jsonschema.ValidationError unless `value` is valid, formats included."""
    validator = jsonschema.Draft202012Validator(
        schema, registry=REMOTE, format_checker=jsonschema.FormatChecker()
    )
    validator.validate(value)


def matches(compiler: GrammarCompiler, constraint: Constraint, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.submit(constraint).result(timeout=PATIENCE_S))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(("schema", "invalid", "keyword", "path"), IGNORED)
def test_a_keyword_xgrammar_would_ignore_where_it_stands_is_refused(schema, invalid, keyword, path) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate(json.loads(invalid), schema)
    message = f"json_schema: {keyword!r} at {path} is a keyword the grammar cannot enforce"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        Constraint(json_schema=json.dumps(schema))


@pytest.mark.parametrize(
    ("schema", "keyword", "path", "written"),
    [
        ({"type": "object", "properties": {"x": {"anyOf": []}}, "required": ["x"]}, "anyOf", "#/properties/x",
         "nothing in its place"),
        ({"oneOf": []}, "oneOf", "#", "nothing in its place"),
        ({"type": "array", "items": {"type": []}}, "type", "#/items", "any value"),
    ],
)  # fmt: skip
def test_an_empty_any_of_one_of_or_type_list_is_refused(schema, keyword, path, written) -> None:
    """No value matches one (jsonschema: none of 1, "a", null, [] and {}); xgrammar wrote nothing in place of
    an empty anyOf or oneOf (`{"x": }` came out with finish_reason "stop"), any value for an empty type."""
    wrap = {"#": lambda v: v, "#/items": lambda v: [v], "#/properties/x": lambda v: {"x": v}}[path]
    for value in (1, "a", None, [], {}):
        with pytest.raises(jsonschema.ValidationError):
            validate(wrap(value), schema)
    with pytest.raises(ValueError) as info:
        Constraint(json_schema=json.dumps(schema))
    assert str(info.value) == (
        f"json_schema: {keyword!r} at {path} is a keyword the grammar cannot enforce (xgrammar), so the "
        f"output could break it; leave it out (an empty list, which no value matches; xgrammar writes "
        f"{written})"
    )


@pytest.mark.parametrize(("schema", "valid", "invalid"), ENFORCED)
def test_an_accepted_schema_holds_the_output_to_it(compiler: GrammarCompiler, schema, valid, invalid) -> None:
    constraint = Constraint(json_schema=json.dumps(schema))
    validate(json.loads(valid), schema)
    assert matches(compiler, constraint, valid)
    try:
        value = json.loads(invalid)
    except json.JSONDecodeError:
        pass  # not JSON at all
    else:
        with pytest.raises(jsonschema.ValidationError):
            validate(value, schema)
    assert not matches(compiler, constraint, invalid)


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        (
            {"type": "string", "pattern": "^(?!admin$)[a-z]+$"},
            "'^(?!admin$)[a-z]+$' has the lookahead '(?!' at position 1, which xgrammar drops",
        ),
        (
            {"type": "string", "pattern": "a$b"},
            "'a$b' has the anchor '$' at position 1, which xgrammar drops inside a pattern (an anchor may "
            "stand only at the start or end of the pattern or of a top-level alternative)",
        ),
        (
            {"type": "object", "properties": {"id": {}, "max": {}}, "patternProperties": {"x": {}}},
            "'x' may name the listed property 'max', which xgrammar writes with the property's schema alone",
        ),
    ],
)
def test_a_refused_pattern_says_what_xgrammar_would_do_with_it(schema, why) -> None:
    """A pattern is refused only for what it holds (others compile): the message says which part."""
    with pytest.raises(ValueError) as info:
        Constraint(json_schema=json.dumps(schema))
    assert str(info.value).endswith(f"; leave it out ({why})"), str(info.value)
    with pytest.raises(ValueError) as info:
        Tool("f", parameters=json.dumps({"type": "object", "properties": {"p": schema}}))
    assert str(info.value) == (
        f"tools.parameters: 'f' has {unenforced_keyword(schema).keyword!r} at #/properties/p, a keyword the "
        f"grammar cannot enforce; leave it out ({why})"
    )


def test_properties_that_are_no_object_are_left_to_xgrammars_own_refusal() -> None:
    """Not "'patternProperties' ... leave it out" (a caller who did would meet xgrammar's "properties must
    be an object" next)."""
    assert unenforced_keyword({"properties": ["a"], "patternProperties": {"^x-": {}}}) is None


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ('{"type": "string", "format": ["email"]}', "json_schema: 'format' at # is a keyword"),
        (
            '{"properties": {"a": {"format": {"x": 1}}}}',
            "json_schema: 'format' at #/properties/a is a keyword",
        ),
        ('{"type": "object", "properties": {"a": {}}, "required": [["a"]]}', "json_schema: 'required' at #"),
        ('{"items": ' * 3000 + "{}" + "}" * 3000, "json_schema: nests too deeply"),
    ],
)
def test_a_malformed_schema_is_a_bad_argument_naming_the_field(schema, message) -> None:
    """Shapes JSON Schema does not allow (a format or a required name that is no string), once a TypeError
    in our checks, and nesting past the JSON parser's recursion limit, once a RecursionError: both gRPC
    INTERNAL. A tool's parameters are checked the same way."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        Constraint(json_schema=schema)
    field = "tools.parameters: 'f'" if "nests" not in message else "tools.parameters"
    with pytest.raises(ValueError, match=f"^{re.escape(field)}"):
        Tool("f", parameters=schema.replace('"type": "string", ', ""))
