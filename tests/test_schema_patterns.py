"""Which assertions of a regex xgrammar drops (and so are refused), and which names a JSON Schema pattern
may match: every name it matches by Python's `re` (which `jsonschema`, the reference, validates patterns
with; these patterns read alike in it and in ECMAScript), and none without a literal it needs."""

from __future__ import annotations

import random
import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.schema_patterns import (
    json_escaped,
    misread_part,
    names_it_may_match,
    xgrammar_regex,
)

NAMES = ["a", "ab", "ba", "x_id", "max", "$5", "a$b", "", "A-1"]


@pytest.mark.parametrize(
    "pattern",
    [
        *(
            "^a+$",
            "^a+$|^b$",
            "a|^b",
            "a$|b",
            r"^\$[0-9]+$",
            "[^$]+$",
            r"[\]^$]",
            "^(?:a|b)$",
            "(a)|b",
            "^$",
            "",
        ),
        *(r"\A[a-z]+\Z", r"^\d+\z", r"\x41\u0042\U00000043\u{44}\cJ\0[\b\x00-\x1f]\d\W\s\.\-\/"),
        r"^[a-zA-Z0-9\_\-]+$",  # an escaped underscore is one
    ],
)
def test_anchors_at_the_edges_and_escapes_xgrammar_reads_as_python_are_kept(pattern) -> None:
    assert misread_part(pattern) is None


@pytest.mark.parametrize(
    ("pattern", "part"),
    [
        ("a$b", "the anchor '$' at position 1, which xgrammar drops inside a pattern (an anchor may"),
        ("^(a$|b)c$", "the anchor '$' at position 3, which"),
        ("(^a)", "the anchor '^' at position 1, which"),
        ("^^a", "the anchor '^' at position 1, which"),
        (r"\$^", "the anchor '^' at position 2, which"),
        (r"a\Zb", "the anchor '\\\\Z' at position 1, which"),
        ("^(?!admin$)[a-z]+$", "the lookahead '(?!' at position 1, which xgrammar drops"),
        ("x(?=y)", "the lookahead '(?=' at position 1, which xgrammar drops"),
        # Escapes xgrammar reads as the letter itself (Python's \h, \Q, \e; ECMAScript's \p in a class) or
        # otherwise (octal escapes and back-references), and classes the two dialects read apart.
        (r"^\h+$", "the escape '\\\\h' at position 1, which xgrammar reads as the letter 'h'"),
        (r"a\Q.\E", "the escape '\\\\Q' at position 1, which xgrammar reads as the letter 'Q'"),
        (r"[\p{L}\d]+", "the escape '\\\\p{L}' at position 1, which xgrammar reads as the letter 'p'"),
        (r"\x{41}", "the escape '\\\\x' at position 0, which xgrammar reads as the letter 'x'"),
        (r"a\00", "the escape '\\\\00' at position 1, which xgrammar reads otherwise (an octal escape or"),
        (r"[^\1]", "the escape '\\\\1' at position 2, which xgrammar reads otherwise"),
        (r"\[[^]]*\]", "the class '[^]' at position 2, which Python and ECMAScript read differently"),
        (r"[]a]", "the class '[]' at position 0, which Python and ECMAScript read differently"),
    ],
)
def test_a_part_xgrammar_drops_or_misreads_is_named_with_its_position(pattern, part) -> None:
    assert misread_part(pattern).startswith(part), misread_part(pattern)


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
        if misread_part(pattern) is not None:
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
        (r'[\u00e9"a-c\U0001F600]', r'(?:[\u00e9a-c\u{1f600}]|\\")'),  # beyond ASCII as escapes
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
        ("a$b", "regex: the pattern has the anchor '$' at position 1, which xgrammar drops inside a pattern"),
        ("(?!a).", "regex: the pattern has the lookahead '(?!' at position 0, which xgrammar drops"),
        (r"^\d+\h", "regex: the pattern has the escape '\\\\h' at position 4, which xgrammar reads as the"),
    ],
)
def test_a_regex_constraint_with_a_part_xgrammar_misreads_is_refused(regex, message) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        Constraint(regex=regex)
    assert Constraint(regex="^a+$|^b$").regex == "^a+$|^b$"


@pytest.mark.parametrize("regex", ["[ab", "x[a-z", "[a-", "b[^", r"[a\]", "[a-z]{2}[0-"])
def test_a_class_never_closed_is_left_for_xgrammar_to_refuse(regex) -> None:
    """The rewrite of a text regex's classes closed it (`[ab` became `[a]`, `b[^` anything but b), and so
    did a schema pattern's JSON rewrite where the pattern ended in an escaped "]" (`[a\\]` became "a" or a
    backslash): the request ran under a pattern it never sent, where Python, ECMAScript and xgrammar
    refuse it."""
    with pytest.raises(re.error):
        re.compile(regex)
    assert xgrammar_regex(regex, text=True) == regex
    assert json_escaped(xgrammar_regex(regex, text=False)) == regex
    with pytest.raises(RuntimeError, match="Regex parsing error"):
        xgr.Grammar.from_regex(xgrammar_regex(regex, text=True))


# (regex, strings Python's re.fullmatch takes, strings it refuses that xgrammar's own reading took).
REGEXES = [
    (r"[\^$.|?*+()]+", ["^", "$.", "()"], ["x", "abc"]),  # a caret first in a class was a negation
    (r"[\^a-z]+", ["^", "ab^"], ["ABC"]),
    (r"[\^-a]", ["^", "_", "a"], ["b", "x"]),  # a range that starts at the caret
    (r"[\^]", ["^"], ["x"]),
    (r"^\d+\Z", ["12"], ["12Z"]),  # \Z was the letter Z
    (r"\A[a-z]+\Z", ["slug"], ["AslugZ"]),
    (r"\x41b", ["Ab"], ["\u041b"]),  # \x took every hex digit after it
    (r"[\x00-\x1fa]", ["\x01", "a"], ["\u00e9", "\u01fa"]),
    (r"[\x30-\x39a-f]+", ["5a", "f"], ["\u00e9~"]),
    (r"[\u0010a]", ["\x10", "a"], ["\u010a"]),  # a control character before a hex digit: one code point
    (r"[^\x00-\x1fa]+", ["b", "\u00e9"], ["a", "\x01"]),
    (r"[\x01a-]", ["\x01", "a", "-"], ["b", "\x00"]),  # the dash stays a dash wherever the class puts it
    (r"[b\u00e0-\u00ffa-c]", ["b", "\u00e0", "\u00ff", "c"], ["-", "\u0130", "\u017f"]),  # not up to U+0FFA
    (r"[\u00ffa]", ["\u00ff", "a"], ["\u0ffa"]),
    (r"[\0\n\ra]", ["\x00", "\n", "\r", "a"], ["0", "n"]),
]


@pytest.mark.parametrize(("regex", "matching", "refused"), REGEXES)
def test_a_regex_matches_what_python_matches(regex, matching, refused) -> None:
    """Through `xgrammar_regex`, as the grammar compiler writes a `regex` constraint for xgrammar."""
    grammar = xgr.Grammar.from_regex(xgrammar_regex(regex, text=True))
    for text in matching:
        assert re.fullmatch(regex, text) and _is_grammar_accept_string(grammar, text), text
    for text in refused:
        assert not re.fullmatch(regex, text) and not _is_grammar_accept_string(grammar, text), text
