"""Numbers xgrammar cannot write as a JSON schema means them, refused: bounds of a `number` with no number
of at most 6 decimal places between them (xgrammar's rule is then the empty string), and integers no
double holds (as `const`, `enum` or a `number`'s bound xgrammar rounds them). xgrammar itself is the
oracle of the first: the schema is refused exactly where its grammar takes the empty text."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.schema_numbers import unwritable_number


def _grammar(schema: dict) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def _random_bounds(rng: random.Random) -> dict:
    """Two bounds a few millionths apart or less, each inclusive or exclusive, around 0 or another number."""
    base = rng.choice([0.0, 1.0, -2.0, 0.5, 123.456])
    low = base + rng.choice([-1, 1]) * rng.randint(0, 30) * 10 ** -rng.randint(6, 8)
    high = low + rng.randint(0, 30) * 10 ** -rng.randint(6, 8)
    return {
        rng.choice(["minimum", "exclusiveMinimum"]): round(low, 10),
        rng.choice(["maximum", "exclusiveMaximum"]): round(high, 10),
    }


def test_bounds_are_refused_exactly_where_xgrammars_grammar_holds_no_number() -> None:
    rng = random.Random(0)
    refused = 0
    for _ in range(300):
        schema = {"type": "number", **_random_bounds(rng)}
        try:
            empty = _is_grammar_accept_string(_grammar(schema), "")
        except RuntimeError:  # "Invalid range: empty range": no number at all lies within
            empty = True
        assert (unwritable_number(schema, ["number"]) is not None) == empty, schema
        refused += empty
    assert 30 < refused < 270  # both sides of the rule were met


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "minimum": 1e-7, "maximum": 2e-7},
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-6},
        {"type": ["number", "null"], "minimum": 5.0000001, "maximum": 5.0000009},
    ],
)
def test_a_range_without_a_number_xgrammar_writes_is_refused(schema) -> None:
    """Nested, its grammar took `{"x": }`: no value at all."""
    nested = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    assert _is_grammar_accept_string(_grammar(nested), '{"x": }')
    with pytest.raises(ValueError) as info:
        Constraint(json_schema=nested)
    assert str(info.value).startswith(
        f"json_schema: {next(k for k in schema if 'imum' in k)!r} at #/properties/x "
    )
    assert str(info.value).endswith("xgrammar writes no other: the output would hold no value)")


@pytest.mark.parametrize(
    ("schema", "written", "why"),
    [
        (
            {"const": 12345678901234567890},
            "1.2345678901234567e+19",
            "no double holds 12345678901234567890; xgrammar writes it as 1.2345678901234567e+19",
        ),
        (
            {"enum": [1, {"id": [2**63 + 1]}]},
            '{"id":[9.223372036854776e+18]}',  # as xgrammar writes an enum's value
            "no double holds 9223372036854775809; xgrammar writes it as 9.223372036854776e+18",
        ),
        (
            {"type": "number", "minimum": 2**53 + 1},
            str(2**53),
            "no double holds 9007199254740993; xgrammar writes it as 9007199254740992.0",
        ),
    ],
)
def test_an_integer_no_double_holds_is_refused(schema, written, why) -> None:
    """xgrammar's grammar took the rounded number, which the schema refuses."""
    assert _is_grammar_accept_string(_grammar(schema), written)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(written), schema)
    with pytest.raises(ValueError) as info:
        Constraint(json_schema=schema)
    assert str(info.value).endswith(f"; leave it out ({why})"), str(info.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "minimum": 1e-6, "maximum": 1e-6},
        {"type": "number", "minimum": 0, "exclusiveMaximum": 1e-6},
        {"type": "number", "minimum": 1e-7},
        {"type": "integer", "minimum": 2**53 + 1},  # an integer's bounds xgrammar holds exactly
        {"const": 2**64},  # a double holds it
        {"enum": [1.5, -(2**53)]},
    ],
)
def test_numbers_xgrammar_writes_as_meant_are_accepted(schema) -> None:
    assert Constraint(json_schema=schema).json_schema == json.dumps(schema)
    assert not _is_grammar_accept_string(_grammar(schema), "")


@pytest.mark.parametrize("bounds", ['"minimum": -Infinity, "maximum": 1', '"minimum": NaN, "maximum": 1'])
def test_a_bound_that_is_no_finite_number_is_left_to_xgrammar(bounds) -> None:
    """Python's json reads NaN and Infinity; the check passes them by (it raised OverflowError, INTERNAL),
    and xgrammar refuses them when the grammar compiles."""
    text = f'{{"type": "number", {bounds}}}'
    assert Constraint(json_schema=text).json_schema == text
