"""Which assertions of a regex xgrammar drops (and so are refused), and which names a JSON Schema pattern
may match: every name it matches by Python's `re` (which `jsonschema`, the reference, validates patterns
with; these patterns read alike in it and in ECMAScript), and none without a literal it needs."""

from __future__ import annotations

import random
import re

import pytest

from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.schema_patterns import ignored_assertion, json_escaped, names_it_may_match

NAMES = ["a", "ab", "ba", "x_id", "max", "$5", "a$b", "", "A-1"]


@pytest.mark.parametrize(
    "pattern",
    ["^a+$", "^a+$|^b$", "a|^b", "a$|b", r"^\$[0-9]+$", "[^$]+$", r"[\]^$]", "^(?:a|b)$", "(a)|b", "^$", ""],
)
def test_anchors_at_the_edges_of_the_pattern_or_of_a_top_level_alternative_are_kept(pattern) -> None:
    assert ignored_assertion(pattern) is None


@pytest.mark.parametrize(
    ("pattern", "part"),
    [
        ("a$b", "the anchor '$' at position 1"),
        ("^(a$|b)c$", "the anchor '$' at position 3"),
        ("(^a)", "the anchor '^' at position 1"),
        ("^^a", "the anchor '^' at position 1"),
        (r"\$^", "the anchor '^' at position 2"),
        ("^(?!admin$)[a-z]+$", "the lookahead '(?!' at position 1"),
        ("x(?=y)", "the lookahead '(?=' at position 1"),
    ],
)
def test_an_assertion_elsewhere_is_named_with_its_position(pattern, part) -> None:
    assert ignored_assertion(pattern) == part


# (pattern, the names of NAMES it may match: those it matches, and those it is not read closely enough to
# rule out).
MAY_MATCH = [
    ("x", ["x_id", "max"]),
    ("^x_", ["x_id"]),
    ("_id$", ["x_id"]),
    ("^[a-z]+_id$", ["x_id"]),
    ("^x-", []),
    (r"^\$[0-9]+$", ["$5"]),
    ("a.b", ["ab", "ba", "a$b"]),  # needs "a" and "b", in either order here
    ("^ab?$", ["a", "ab", "a$b"]),  # "b" is optional: the name starts with "a"
    ("^a{2}$", NAMES),  # bounds: no literal needed
    ("^(ab)+$", NAMES),
    (r"^\u0041-\d$", ["A-1"]),  # "A" spelled as an escape
    ("^a|b$", NAMES),  # alternatives
    ("(?i)^A", NAMES),  # a flag
    ("", NAMES),
]


@pytest.mark.parametrize(("pattern", "may_match"), MAY_MATCH)
def test_a_pattern_may_match_every_name_it_matches_and_none_without_a_literal_it_needs(
    pattern, may_match
) -> None:
    assert names_it_may_match(pattern, NAMES) == may_match
    matched = [name for name in NAMES if re.search(pattern, name)]
    assert set(matched) <= set(may_match), matched


def _random_pattern(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", "x", "_", "-", r"\.", ".", "[ab]", "[^a]", r"\d", r"\u0061", "[x]"]
    parts = []
    for _ in range(rng.randint(0, 4)):
        part = (
            rng.choice(atoms) if depth > 1 or rng.random() < 0.8 else f"({_random_pattern(rng, depth + 1)})"
        )
        parts.append(part + rng.choice(["", "", "", "*", "+", "?", "{1,2}", "{2}"]))
    pattern = "".join(parts)
    if rng.random() < 0.2:
        pattern += "|" + _random_pattern(rng, depth + 1)
    return (
        ("^" if depth == 0 and rng.random() < 0.4 else "")
        + pattern
        + ("$" if depth == 0 and rng.random() < 0.4 else "")
    )


def test_no_random_pattern_matches_a_name_ruled_out() -> None:
    """Soundness: a name that a pattern matches (Python's `re`) is never one it is taken not to match."""
    rng = random.Random(0)
    names = ["".join(rng.choice("abx_-.1") for _ in range(rng.randint(0, 6))) for _ in range(60)]
    checked = 0
    for _ in range(3000):
        pattern = _random_pattern(rng)
        if ignored_assertion(pattern) is not None:
            continue
        matched = {name for name in names if re.search(pattern, name)}
        assert matched <= set(names_it_may_match(pattern, names)), pattern
        checked += 1
    assert checked > 2000


def test_a_backtracking_pattern_is_never_run() -> None:
    """Python's `re` takes 2^40 steps here (the frontend's event loop would hang): the pattern is read,
    not run. Fails by the test's timeout, not by a measured time."""
    assert names_it_may_match("^(a+)+$", ["a" * 40 + "b", "c"]) == ["a" * 40 + "b", "c"]
    assert names_it_may_match("^x(a+)+$", ["x" + "a" * 40 + "b", "c"]) == ["x" + "a" * 40 + "b"]


@pytest.mark.parametrize(
    ("pattern", "escaped"),
    [
        (r"^C:\\[a-z]+$", r"^C:(?:\\\\)[a-z]+$"),  # the JSON text of one backslash is two
        (r"^\\+$", r"^(?:\\\\)+$"),  # a quantifier repeats the whole escape
        ('^"a"$', r'^(?:\\")a(?:\\")$'),
        (r"\x22[\"]\u0022\u{22}", r'(?:\\")' * 4),
        (r"\n\t[\b]\cA" + "\x01", r"(?:\\n)(?:\\t)(?:\\b)(?:\\u0001)(?:\\u0001)"),
        # A class holding them: the class without them, or their escapes (xgrammar wrote those of a class
        # that held nothing else as they are); a negated class, `.` and `\s` stay as written (xgrammar
        # keeps them out of those).
        (r"[\t\n]", r"(?:\\t|\\n)"),
        (r'[\\"]', r'(?:\\"|\\\\)'),
        (r"[a-z\x00-\x02]", r"(?:[a-z]|\\u0000|\\u0001|\\u0002)"),
        (r"[ -~]", r'(?:[ -!#-\[\]-~]|\\"|\\\\)'),
        (r'[\d"^-]', r'(?:[\d\^\-]|\\")'),
        (r'[^\\"]\d\\d\b\s.', r'[^\\"]\d(?:\\\\)d\b\s.'),
        (r"^[a-z]+\.json$", r"^[a-z]+\.json$"),
        ('[z-a"]', '[z-a"]'),  # a range out of order, left to xgrammar's error
    ],
)
def test_a_literal_a_json_string_must_escape_becomes_its_escape(pattern, escaped) -> None:
    assert json_escaped(pattern) == escaped


@pytest.mark.parametrize(
    ("regex", "message"),
    [
        ("a$b", "regex: the anchor '$' at position 1 is an assertion the grammar cannot enforce (xgrammar)"),
        ("(?!a).", "regex: the lookahead '(?!' at position 0 is an assertion the grammar cannot enforce"),
    ],
)
def test_a_regex_constraint_with_an_assertion_xgrammar_drops_is_refused(regex, message) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        Constraint(regex=regex)
    assert Constraint(regex="^a+$|^b$").regex == "^a+$|^b$"
