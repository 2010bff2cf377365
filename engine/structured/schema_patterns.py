"""The regexes of a constraint as xgrammar and JSON Schema read them, where the two part.

xgrammar holds a string to the whole of a pattern (as vLLM, SGLang and TGI do: JSON Schema's `pattern`
matches anywhere in it), which only narrows what a schema allows. Two parts of a pattern it drops instead,
with a warning ("is ignored"), widening it to strings the pattern refuses: an anchor anywhere but at the
start or end of the pattern or of one of its top-level alternatives (`a$b` holds on no string; xgrammar
takes "ab"), and, inside a JSON schema, a lookahead (`^(?!admin$)[a-z]+$` took "admin"; a `regex`
constraint's fails to compile). It also reads some escapes and classes otherwise than Python and
ECMAScript (`\\h` as "h", Python's `\\A` as "A"): `misread_part` names what it would drop or misread, so
that the constraint can be refused, and `xgrammar_regex` writes the rest as xgrammar reads them right.

Inside a JSON schema xgrammar matches a pattern against the string's JSON text, and keeps `"`, `\\` and
control characters out of its classes and `.`, but writes a literal one as it is (`^C:\\\\[a-z]+$` wrote
`"C:\\ab"`, which does not parse): `json_escaped` writes each as the JSON escape it stands for.

xgrammar also writes a listed property with its own schema alone where a pattern of `patternProperties`
names it too (JSON Schema holds its value to both): `names_it_may_match` tells which listed names a pattern
may name, and `ignored_pattern` refuses a schema where one does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

_LOOKAHEADS = ("(?=", "(?!")
_SYNTAX = frozenset("^$\\.*+?()[]{}|")
_BOUNDS = re.compile(r"\{[0-9]+(,[0-9]*)?\}")
# An escape, whole: a code point (`\u0041`, `\u{41}`, `\x41`, `\cJ`), a Unicode property (`\p{L}`), a
# back-reference (`\k<name>`, `\12`), or a backslash and the character after it.
_ESCAPE = re.compile(
    r"\\(u\{[0-9A-Fa-f]*\}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|x[0-9A-Fa-f]{2}|c[A-Za-z]|[pP]\{[^}]*\}|k<[^>]*>"
    r"|[0-9]+|.?)",
    re.S,
)


# Python's anchors `\A` and `\Z` (and 3.14's `\z`), which xgrammar reads as the letters: at the edges of
# a pattern they say what xgrammar's whole-string match says, so `xgrammar_regex` drops them there.
_EDGE_ANCHORS = {"\\A": "^", "\\Z": "$", "\\z": "$"}
# Escaped letters xgrammar reads as Python and ECMAScript do (classes, controls, code points); `\b`, `\B`,
# `\p`, `\P` and `\k` outside a class it refuses itself, naming them.
_READ_LETTERS = frozenset("dDwWsSnrtfvcxuU")
_REFUSED_LETTERS = frozenset("bBpPk")


def misread_part(pattern: str) -> str | None:
    """The first part of the regex `pattern` that xgrammar drops or reads otherwise than Python and
    ECMAScript, described with its position ("the anchor '$' at position 1, which xgrammar drops inside
    a pattern"); None if there is none. An anchor at the start or the end of the pattern or of a top-level
    alternative (`^a+$|^b$`, `\\A...\\Z`) is kept: matching the whole string, xgrammar holds it."""
    depth = 0
    at_branch_start = True  # nothing of the current top-level alternative read yet
    atoms = list(_atoms(pattern))
    for k, (i, atom) in enumerate(atoms):
        if pattern.startswith(_LOOKAHEADS, i):
            return f"the lookahead {pattern[i : i + 3]!r} at position {i}, which xgrammar drops"
        anchor = _EDGE_ANCHORS.get(atom, atom)
        following = atoms[k + 1][1] if k + 1 < len(atoms) else ""
        if (anchor == "^" and not (depth == 0 and at_branch_start)) or (
            anchor == "$" and not (depth == 0 and following in ("", "|"))
        ):
            return (
                f"the anchor {atom!r} at position {i}, which xgrammar drops inside a pattern (an anchor may "
                "stand only at the start or end of the pattern or of a top-level alternative)"
            )
        if misread := _misread_atom(i, atom):
            return misread
        depth += (atom == "(") - (atom == ")")
        at_branch_start = atom == "|" and depth == 0
    return None


def _misread_atom(position: int, atom: str) -> str | None:
    """How xgrammar misreads this atom of a pattern (an escape, or a class and the escapes in it)."""
    if atom.startswith("\\") and atom not in _EDGE_ANCHORS:
        return _misread_escape(position, atom, in_class=False)
    if not atom.startswith("["):
        return None
    inner = atom[2:] if atom.startswith("[^") else atom[1:]
    if inner.startswith("]"):
        return (
            f"the class {atom!r} at position {position}, which Python and ECMAScript read differently "
            "(write '\\]' for a ']' in it)"
        )
    offset = position + len(atom) - len(inner)
    for item in _CLASS_ITEM.finditer(inner[:-1]):
        if item.group().startswith("\\") and (
            misread := _misread_escape(offset + item.start(), item.group(), in_class=True)
        ):
            return misread
    return None


def _misread_escape(position: int, escape: str, in_class: bool) -> str | None:
    """How xgrammar misreads `escape`, if it does: a letter it does not know (`\\h`, `\\Q`, `\\p` in a
    class: the letter itself), `\\x` or `\\u` without their digits, an octal escape or back-reference."""
    body = escape[1:]
    if not body or not body[0].isalnum():
        return None  # a backslash at the end (xgrammar refuses it), an escaped punctuation mark or "_"
    where = f"the escape {escape!r} at position {position}, which xgrammar reads"
    if body[0].isdigit():
        return None if body == "0" else f"{where} otherwise (an octal escape or a back-reference)"
    if body[0] in "xuUc":
        return None if _one_char(escape, in_class) is not None else f"{where} as the letter {body[0]!r}"
    if body[0] in _READ_LETTERS or (body[0] == "b" and in_class):
        return None
    if body[0] in _REFUSED_LETTERS and not in_class:
        return None
    return f"{where} as the letter {body[0]!r}"


def xgrammar_regex(pattern: str, text: bool) -> str:
    """`pattern` written for xgrammar to read it as Python and ECMAScript do, its anchors where
    `misread_part` allows them: `\\xHH` as `\\u00HH` (xgrammar's `\\x` took every hex digit after it:
    `\\x41b` was U+041B), `\\A`, `\\Z` and `\\z` dropped; and where the pattern matches `text` (a `regex`
    constraint, a structural tag's regex) rather than a JSON string, a class that starts with its caret
    (`[\\^x]`) rewritten without it first (xgrammar's regex converter made it a negation: anything but x)."""
    written = []
    for _, atom in _atoms(pattern):
        if atom in _EDGE_ANCHORS:
            continue
        if atom.startswith("[") and _closed(atom):  # one never closed stays, for xgrammar to refuse
            atom = _class_for_text(atom) if text else _HEX2.sub(_as_u00, atom)
        elif _HEX2.fullmatch(atom):
            atom = _as_u00(_HEX2.fullmatch(atom))
        written.append(atom)
    return "".join(written)


_HEX2 = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9A-Fa-f]{2})")


def _closed(atom: str) -> bool:
    """Whether the class `atom` (from `_atoms`) ends with its closing "]": `[ab` and `[a\\]` do not."""
    end = 1
    while end < len(atom) and atom[end] != "]":
        end += 2 if atom[end] == "\\" else 1
    return end == len(atom) - 1


def _as_u00(match: re.Match) -> str:
    return f"{match[1]}\\u00{match[2]}"


def _class_for_text(atom: str) -> str:
    """A class `[...]` rewritten for xgrammar's regex converter, which turns the escapes of a class into
    `\\x` text and reads that again: an escaped character below U+0100 before a hex digit became one code
    point (`[\\x00-\\x1fa]` matched "é", `[\\u00ffa]` only U+0FFA), so each character is written as
    itself (a newline, a carriage return and a NUL, which it refuses as they are, escaped, the NUL last);
    and a caret first became a negation (`[\\^x]` matched anything but x), so it goes after the others
    (alone, it leaves the class)."""
    negated = atom.startswith("[^")
    pieces = [
        (
            text if first is None else _text_char(first) + (f"-{_text_char(last)}" if last != first else ""),
            first,
            last,
        )
        for text, first, last in _class_pieces(atom)
    ]
    nuls = [p for p in pieces if p[2] == "\0"]
    carets = [p for p in pieces if p not in nuls and not negated and p[1] == "^"]
    others = [p for p in pieces if p not in nuls and p not in carets]
    if carets and not others and not nuls:
        high = max(p[2] for p in carets)
        return "\\^" if high == "^" else f"(?:\\^|[_-{_text_char(high)}])"
    ordered = others + carets + nuls if others or not carets else [nuls[0], *carets, *nuls[1:]]
    return f"[{'^' if negated else ''}{''.join(text for text, _, _ in ordered)}]"


def _class_pieces(atom: str) -> list[tuple[str, str | None, str | None]]:
    """(text, first character, last character) of each piece of the class `atom`, after its caret if
    negated: a character (first = last), a range, or what matches no one character (`\\d`, `\\p{L}`:
    None, None)."""
    items = [m.group() for m in _CLASS_ITEM.finditer(atom[2 if atom.startswith("[^") else 1 : -1])]
    pieces = []
    i = 0
    while i < len(items):
        first = _one_char(items[i], in_class=True)
        last = _one_char(items[i + 2], in_class=True) if i + 2 < len(items) and items[i + 1] == "-" else None
        size = 1 if first is None or last is None else 3
        pieces.append(("".join(items[i : i + size]), first, first if size == 1 else last))
        i += size
    return pieces


def _json_class_char(code: int) -> str:
    """One character of a class matched against a JSON string's text: beyond ASCII as an escape (xgrammar
    misread `[\\^ÿ...]` written as it is: it took any ASCII character), else as `_text_char` writes it."""
    if code < 0x80:
        return _text_char(chr(code))
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\u{{{code:x}}}"


# The characters xgrammar's regex converter refuses in a class as they are.
_CLASS_ESCAPES = {"\n": "\\n", "\r": "\\r", "\0": "\\0"}


def _text_char(char: str) -> str:
    """One character of a class, written so that xgrammar reads it back as that character."""
    return _CLASS_ESCAPES.get(char) or (f"\\{char}" if char in "\\]^-[" else char)


def ignored_pattern(schema: dict, reads_pattern: bool) -> tuple[str, str] | None:
    """(keyword, why) of a regex of this one schema that xgrammar would not hold the output to: one with a
    part it drops or misreads (`misread_part`), or a pattern of `patternProperties` that names a listed
    property, which xgrammar writes with the property's own schema alone (JSON Schema holds it to both).
    `reads_pattern`: whether the schema's own `pattern` holds (a string's schema)."""
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and reads_pattern and (part := misread_part(pattern)):
        return "pattern", f"{pattern!r} has {part}"
    patterns, properties = schema.get("patternProperties"), schema.get("properties")
    if not isinstance(patterns, dict):
        return None
    for key in patterns:
        if part := misread_part(key):
            return "patternProperties", f"{key!r} has {part}"
    for key in patterns if isinstance(properties, dict) else ():
        if named := names_it_may_match(key, list(properties)):
            return "patternProperties", (
                f"{key!r} may name the listed property {named[0]!r}, which xgrammar writes with the "
                "property's schema alone"
            )
    return None


def names_it_may_match(pattern: str, names: list[str]) -> list[str]:
    """The `names` that JSON Schema's `pattern` (matching anywhere in a name) may match: all but those
    without a literal the pattern needs (`^x-` needs a name to start with "x-", `_id$` to end with "_id",
    `a.b` to hold "a" and "b"). Read from the pattern's text, never by running it on the names: the
    frontend's event loop would wait out a backtracking one (`^(a+)+$` against "aaa...ab") under Python's
    `re`, and xgrammar takes seconds to import there. A pattern of alternatives, or with a flag or an
    assertion group (`(?i)`, `(?<=`), is taken to match any name. `pattern` has its anchors only where
    `misread_part` allows them."""
    atoms = [atom for _, atom in _atoms(pattern)]
    if "|" in atoms or "(?" in pattern.replace("(?:", ""):
        return names
    anchored_start, anchored_end = atoms[:1] == ["^"], atoms[-1:] == ["$"]
    body = atoms[int(anchored_start) : len(atoms) - int(anchored_end)]
    runs, run, depth = [], "", 0  # the literals each match holds, in the order it holds them
    for k, atom in enumerate(body):
        literal = _one_char(atom) if depth == 0 else None
        if literal is not None and not (k + 1 < len(body) and _is_quantifier(body[k + 1])):
            run += literal
            continue
        runs.append(run)
        run = ""
        depth += (atom == "(") - (atom == ")")
    runs.append(run)
    prefix, suffix = runs[0] if anchored_start else "", runs[-1] if anchored_end else ""
    return [
        name
        for name in names
        if name.startswith(prefix) and name.endswith(suffix) and all(r in name for r in runs)
    ]


def json_escaped(pattern: str) -> str:
    """`pattern` with each literal character that a JSON string holds only as an escape (`"`, `\\`, a
    control character; written as it is, or escaped as `\\\\`, `\\n` or `\\x22`) made a group matching its
    JSON escape (`\\\\` -> `(?:\\\\\\\\)`), so that a quantifier after it repeats the whole escape; and each
    class holding such characters a group of the class without them and their escapes (`_json_class`)."""
    written = []
    for _, atom in _atoms(pattern):
        char = _one_char(atom)
        if char is not None and ord(char) in _JSON_ESCAPED:
            atom = f"(?:{_json_escape(ord(char))})"
        elif atom.startswith("[") and (group := _json_class(atom)) is not None:
            atom = group
        written.append(atom)
    return "".join(written)


# The characters a JSON string holds only as escapes: the control characters, the quote and the backslash.
_JSON_ESCAPED = frozenset([*range(0x20), ord('"'), ord("\\")])
# An item of a class: an escape, whole, or one character.
_CLASS_ITEM = re.compile(rf"{_ESCAPE.pattern}|.", re.S)


def _json_escape(code: int) -> str:
    """A regex of the JSON escape of one character of _JSON_ESCAPED (`\\\\n` for a newline)."""
    return re.escape(json.dumps(chr(code))[1:-1])


def _json_class(atom: str) -> str | None:
    """A class holding characters of _JSON_ESCAPED (`[\\t\\n]`, `[ -~]`), as a group of the class without
    them and the JSON escape of each: xgrammar wrote those of a class that holds nothing else as they are.
    Beside other characters it still leaves the escapes out (the class's first characters and the escapes'
    backslash meet in one of its character sets, which keeps a backslash out): narrower, never wider. None
    for a class without them, for a negated class (xgrammar keeps them out of it, as it should), and for
    one never closed (left for xgrammar to refuse)."""
    if atom.startswith("[^") or not _closed(atom):
        return None
    kept, escaped = [], set()
    for text, low, high in _class_pieces(atom):
        if low is None:  # \d, \s, \w, \p{...}: xgrammar keeps the characters out of these itself
            kept.append(text)
            continue
        first, last = ord(low), ord(high)
        if last < first:
            return None  # a range out of order: xgrammar's error says so
        inside = sorted(c for c in _JSON_ESCAPED if first <= c <= last)
        escaped.update(inside)
        starts, ends = [first] + [c + 1 for c in inside], [c - 1 for c in inside] + [last]
        for start, end in zip(starts, ends, strict=True):  # the runs between them
            if start <= end:
                kept.append(_json_class_char(start) + (f"-{_json_class_char(end)}" if end > start else ""))
    if not escaped:
        return None
    alternatives = ([f"[{''.join(kept)}]"] if kept else []) + [_json_escape(c) for c in sorted(escaped)]
    return f"(?:{'|'.join(alternatives)})"


# The escapes of one character by a letter (`\b` stands for one inside a class only).
_LETTER_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}


def _one_char(atom: str, in_class: bool = False) -> str | None:
    """The one character `atom` matches, if it matches one: a plain character, an escape of one, or a
    class of one (`[\\\\]`, not `[^\\\\]`)."""
    if len(atom) == 1:
        return atom if in_class or atom not in _SYNTAX else None
    if atom.startswith("[") and atom.endswith("]") and not in_class and len(atom) > 2 and atom[1] != "^":
        inner = list(_atoms(atom[1:-1]))
        return _one_char(inner[0][1], in_class=True) if len(inner) == 1 else None
    if not atom.startswith("\\") or len(atom) < 2:
        return None
    body = atom[1:]
    if len(body) == 1:
        if body == "b" and in_class:
            return "\b"
        return _LETTER_ESCAPES.get(body, None if body.isalnum() else body)
    if body[0] in "xuU" and (digits := body[1:].strip("{}")) and body[1:] in (digits, f"{{{digits}}}"):
        return chr(int(digits, 16)) if int(digits, 16) <= 0x10FFFF else None
    if body[0] == "c" and len(body) == 2:
        return chr(ord(body[1]) % 32)
    return None


def _is_quantifier(atom: str) -> bool:
    return atom in ("*", "+", "?") or _BOUNDS.fullmatch(atom) is not None


def _atoms(pattern: str) -> Iterator[tuple[int, str]]:
    """(position, text) of each character of `pattern`, an escape (`\\$`, `\\u0041`), a class (`[^$]`, to its
    first unescaped "]": ECMAScript's, where "[]" is an empty class) or bounds (`{2,5}`) taken whole."""
    i = 0
    while i < len(pattern):
        end = i + 1
        if escape := _ESCAPE.match(pattern, i):
            end = escape.end()
        elif pattern[i] == "[":
            while end < len(pattern) and pattern[end] != "]":
                end += 2 if pattern[end] == "\\" else 1
            end += 1
        elif bounds := _BOUNDS.match(pattern, i):
            end = bounds.end()
        yield i, pattern[i:end]
        i = end
