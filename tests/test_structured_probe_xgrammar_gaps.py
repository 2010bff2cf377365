"""Where xgrammar's grammar of a JSON schema matched outputs the schema refuses, found by sampling random
schemas on a random-weight model and checking every output with `jsonschema` and the formats' parsers:
an integer's `multipleOf` beside one bound, a wide range or above 1024 (xgrammar drops it: refused, as the
other keywords it ignores are); the formats ipv4, date, time, date-time, hostname and ipv6 (their grammars
let through "01.2.3.4", "2023-11-31", ":60", labels over 63 characters, "::01.2.3.4": compiled as strict
patterns instead);
a pattern's optional group holding a repetition (`(xy+)?` matched "y": written `{0,1}` for xgrammar); a
pattern's literal backslash, quote or control character (written unescaped in the JSON string). And
a tool call whose arguments hold a lone surrogate escape, which no protobuf string (UTF-8) could carry."""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import random
import re

import pytest
import xgrammar as xgr
from service_harness import PATIENCE_S
from xgrammar.testing import _is_grammar_accept_string

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.grammar_compiler import STRICT_FORMATS, GrammarCompiler
from sluice.engine.structured.tool_calls import Tool, ToolUse

# (an integer schema with multipleOf, a value xgrammar's own grammar of it matched, though no multiple).
IGNORED_MULTIPLE_OF = [
    ({"minimum": 0}, 4),
    ({"exclusiveMinimum": 0}, 4),
    ({"maximum": 30}, -4),
    ({"minimum": 0, "maximum": 10_000}, 4),
    ({"exclusiveMinimum": -1, "exclusiveMaximum": 10_001}, 4),
]
# Bounds xgrammar enforces multipleOf 3 between: 10,000 integers at most.
ENFORCED_MULTIPLE_OF = [
    {},
    {"minimum": 0, "maximum": 9_999},
    {"exclusiveMinimum": -1, "exclusiveMaximum": 10_000},
    {"minimum": -5, "exclusiveMinimum": 0, "maximum": 10_000},
]
# (format, strings it holds, strings it refuses that xgrammar's grammar of the format matched).
FORMATS = [
    ("ipv4", ["0.0.0.0", "255.255.255.255", "10.0.0.9"], ["01.2.3.4", "10.0.0.09", "00.0.0.0"]),
    (
        "date",
        ["2024-02-29", "2000-02-29", "2023-04-30", "2023-12-31", "0001-01-01", "0400-02-29", "9999-12-31"],
        ["2023-02-29", "1900-02-29", "2023-11-31", "0000-01-01", "0000-02-29"],
    ),
    ("time", ["23:59:59Z", "00:00:00.123-01:00"], ["23:59:60Z"]),
    (
        "date-time",
        ["2024-02-29T23:59:59Z", "2024-01-01T00:00:00.5+05:30"],
        ["2024-02-30T00:00:00Z", "2024-01-01T12:00:60Z", "0000-01-01T00:00:00Z"],
    ),
    ("hostname", ["a.b", "a" * 63 + ".b", "ab-c.d-e"], ["a" * 64 + ".b", "b." + "c" * 64]),
    (
        "ipv6",
        ["::", "::1", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6::8", "::ffff:1.2.3.4", "FE80::a:10.0.0.9", "1::"],
        ["::01.2.3.4", "::ffff:01.2.3.4", "::1.2.3.04"],
    ),
]
# Patterns with an optional group that holds a repetition, and strings over "abc" of up to 4 characters.
PATTERNS = ["^a(cb+)?$", "^a(b+c)?$", "^(cb*)??d?$", "^a(c[b\\)]{1,3})?$", "^(?:a(cb+)?)+$"]
WORDS = [""] + [
    w + c for w in ["", "a", "b", "c", "aa", "ab", "ac", "ba", "ca", "cb", "abb", "acb"] for c in "abcd"
]


def matches(compiler: GrammarCompiler, schema: dict, value: object, text: str | None = None) -> bool:
    """Whether the grammar the compiler makes of `schema` matches `value` as JSON with `", "` and `": "`
    separators (or `text`)."""
    grammar = compiler.submit(Constraint(json_schema=json.dumps(schema))).result(timeout=PATIENCE_S)
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text or json.dumps(value)) and matcher.is_completed()


def xgrammar_matches(schema: dict, value: object) -> bool:
    """Whether xgrammar's own grammar of `schema`, not ours, matches `value`."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return _is_grammar_accept_string(grammar, json.dumps(value))


@pytest.mark.parametrize(("bounds", "value"), IGNORED_MULTIPLE_OF)
@pytest.mark.parametrize("multiple_of", [3, 1025])
def test_a_multiple_of_xgrammar_drops_is_refused(bounds: dict, value: int, multiple_of: int) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": multiple_of, **bounds}}}
    item = schema["properties"]["n"]
    assert xgrammar_matches(item, value) and value % multiple_of
    message = "json_schema: 'multipleOf' at #/properties/n is a keyword the grammar cannot enforce"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        Constraint(json_schema=json.dumps(schema))
    with pytest.raises(ValueError, match=r"^tools\.parameters: 'f' has 'multipleOf' at #/properties/n"):
        Tool("f", parameters=schema)


def test_multiple_of_above_1024_is_refused_without_bounds_too() -> None:
    assert xgrammar_matches({"type": "integer", "multipleOf": 1025}, 1)
    with pytest.raises(ValueError, match=r"^json_schema: 'multipleOf' at # is a keyword"):
        Constraint(json_schema={"type": "integer", "multipleOf": 1025})


@pytest.mark.parametrize("bounds", ENFORCED_MULTIPLE_OF)
def test_a_multiple_of_xgrammar_enforces_is_accepted_and_holds(compiler: GrammarCompiler, bounds) -> None:
    for multiple_of in (3, 1024):
        schema = {"type": "integer", "multipleOf": multiple_of, **bounds}
        low = max(bounds.get("minimum", -50), bounds.get("exclusiveMinimum", -51) + 1)
        values = range(low, low + 2 * multiple_of + 2)
        assert [v for v in values if matches(compiler, schema, v)] == [
            v for v in values if v % multiple_of == 0
        ]


@pytest.mark.parametrize(("fmt", "valid", "invalid"), FORMATS)
def test_a_format_holds_the_output_to_what_the_format_allows(compiler, fmt, valid, invalid) -> None:
    schema = {"type": "object", "properties": {"v": {"type": ["string", "null"], "format": fmt}}}
    for text in valid:
        assert matches(compiler, schema, {"v": text}), text
    for text in invalid:
        assert xgrammar_matches(schema, {"v": text}), text  # what the compiler used to let through
        assert not matches(compiler, schema, {"v": text}), text
    assert matches(compiler, schema, {"v": None})
    # A format given as data (an enum's value, a default) is no format: the enum's object stays (compact).
    data = {"type": "object", "properties": {"v": {"enum": [{"format": fmt}]}}, "default": {"format": fmt}}
    assert matches(compiler, data, None, f'{{"v": {{"format":"{fmt}"}}}}')


def _random_ipv6(rng: random.Random) -> str:
    """An IPv6 address, often compressed, sometimes ending in IPv4 (an octet with a leading zero now and
    then), sometimes broken (a colon dropped or added)."""
    groups = [format(rng.randrange(65536), rng.choice(["x", "X", "04x"])) for _ in range(8)]
    if rng.random() < 0.4:
        octets = [
            str(rng.randrange(256)) if rng.random() < 0.9 else f"0{rng.randrange(10)}" for _ in range(4)
        ]
        groups = [*groups[:6], ".".join(octets)]
    if rng.random() < 0.7:
        i = rng.randrange(len(groups))
        j = rng.randrange(i, len(groups) + ("." not in groups[-1]))
        text = ":".join(groups[:i]) + "::" + ":".join(groups[j:])
    else:
        text = ":".join(groups)
    if rng.random() < 0.1:
        text = text.replace("::", ":", 1)
    return text + (":" if rng.random() < 0.05 else "")


def test_the_date_pattern_holds_what_pythons_datetime_holds() -> None:
    """Every day of the years 0000-0410 and 1890-2110 (and 31 days of each month), as `jsonschema` checks
    the format."""
    pattern = re.compile(STRICT_FORMATS["date"])
    for year in [*range(0, 411), *range(1890, 2111), 9999]:
        for month, day in itertools.product(range(1, 13), range(1, 32)):
            text = f"{year:04d}-{month:02d}-{day:02d}"
            try:
                valid = datetime.date.fromisoformat(text) is not None
            except ValueError:
                valid = False
            assert bool(pattern.fullmatch(text)) == valid, text


def test_the_ipv6_pattern_holds_what_pythons_ipaddress_holds() -> None:
    """RFC 3986's IPv6address, as `jsonschema` checks the format (Python's ipaddress, no zone)."""
    rng = random.Random(0)
    pattern = re.compile(STRICT_FORMATS["ipv6"])
    for _ in range(20_000):
        text = _random_ipv6(rng)
        try:
            valid = ipaddress.IPv6Address(text).scope_id is None
        except ValueError:
            valid = False
        assert bool(pattern.fullmatch(text)) == valid, text


def test_a_format_inside_a_structural_tag_is_held_as_strictly() -> None:
    from sluice.engine.structured.grammar_compiler import structural_tag_grammar

    schema = {
        "type": "object",
        "properties": {"ip": {"type": "string", "format": "ipv4"}},
        "required": ["ip"],
    }
    tag = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]}
    grammar = structural_tag_grammar(json.dumps(tag))
    assert _is_grammar_accept_string(grammar, '<f>{"ip": "10.0.0.9"}</f>')
    assert not _is_grammar_accept_string(grammar, '<f>{"ip": "10.0.0.09"}</f>')


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_with_an_optional_group_matches_what_python_matches(compiler, pattern: str) -> None:
    expected = [w for w in WORDS if re.fullmatch(pattern, w)]
    for schema, as_value in (
        ({"type": "string", "pattern": pattern}, lambda w: w),
        ({"type": "object", "propertyNames": {"pattern": pattern}, "maxProperties": 1}, lambda w: {w: 1}),
        (
            {"type": "object", "patternProperties": {pattern: {}}, "additionalProperties": False},
            lambda w: {w: 1},
        ),
    ):
        got = [w for w in WORDS if matches(compiler, schema, as_value(w))]
        assert got == expected, (schema, got)


def test_every_sampled_format_parses_as_its_format(llama_dir: str) -> None:
    """A random-weight model at temperature 1: a third of its IPv4 addresses had an octet with a leading
    zero, and some dates a day their month lacks."""
    llm = LLM(llama_dir, block_size=16, num_blocks=128, max_num_seqs=32, attention_backend="torch")
    parsers = {
        "ipv4": ipaddress.IPv4Address,
        "ipv6": ipaddress.IPv6Address,
        "date": datetime.date.fromisoformat,
    }
    for fmt, parse in parsers.items():
        constraint = Constraint(json_schema={"type": "string", "format": fmt})
        params = [
            SamplingParams(max_tokens=64, temperature=1.0, seed=i, constraint=constraint) for i in range(24)
        ]
        for completion in llm.generate(["x"] * 24, params):
            assert completion.finish_reason == "stop", completion.text
            parse(json.loads(completion.text))


def test_every_sampled_string_of_a_pattern_with_quotes_and_backslashes_parses_and_matches(llama_dir) -> None:
    """xgrammar wrote a pattern's literal backslash, quote or control character (or a class of only such)
    as it is in the JSON string (`"C:\\ab"` does not parse); written as their JSON escapes, every output
    parses, and the string it holds matches the pattern (the escapes decoded)."""
    llm = LLM(llama_dir, block_size=16, num_blocks=128, max_num_seqs=32, attention_backend="torch")
    patterns = [
        r"^C:\\[a-z]{1,6}(\\[a-z]{1,6})?$",
        r'^"[a-z ]{1,8}"\t[0-9]$',
        r"^[a-z]{1,4}[\t\n][a-z]{1,4}$",
    ]
    for pattern in patterns:
        schema = {
            "type": "object",
            "properties": {"s": {"type": "string", "pattern": pattern}},
            "required": ["s"],
        }
        params = [
            SamplingParams(max_tokens=48, temperature=1.0, seed=i, constraint=Constraint(json_schema=schema))
            for i in range(16)
        ]
        for completion in llm.generate(["x"] * 16, params):
            assert completion.finish_reason == "stop", completion.text
            assert re.fullmatch(pattern, json.loads(completion.text)["s"]), completion.text


@pytest.mark.parametrize("tool_choice", ["f", "auto"])
def test_a_lone_surrogate_escape_in_arguments_stays_an_escape(tool_choice: str) -> None:
    """json.loads makes "\\ud83d" a lone surrogate, which no UTF-8 string holds: the call's arguments went
    into the response's protobuf string as one, and serializing it raised UnicodeEncodeError."""
    tool_use = ToolUse((Tool("f", parameters={"type": "object"}),), tool_choice)
    written = '{"s": "\\ud83d \\ud83d\\ude00 \\udc00", "\\udfff": "é"}'
    text = (
        written if tool_choice == "f" else f'<tool_call>{{"name": "f", "arguments": {written}}}</tool_call>'
    )
    [call] = tool_use.parse(text)
    assert call.arguments == '{"s": "\\ud83d 😀 \\udc00", "\\udfff": "é"}'
    call.arguments.encode("utf-8")
    assert json.loads(call.arguments) == json.loads(written)
