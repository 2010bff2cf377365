"""What a request's output must match: plain data that crosses to the engine core inside SamplingParams.

Exactly one kind is set. `key` names the compiled grammar in the core's cache, so two requests with the
same constraint share one compilation.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from sluice.engine.structured.schema_numbers import unwritable_number
from sluice.engine.structured.schema_patterns import ignored_pattern, misread_part

ANY_JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class Constraint:
    """One of: `json_schema` (a JSON schema, as text), `regex`, `grammar` (EBNF / GBNF, rule `root`),
    `choice` (the output is exactly one of these strings), `json_object` (any JSON object),
    `structural_tag` (vLLM's, as JSON text: xgrammar's `{"type": "structural_tag", "format": ...}`, or the
    older `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}`: free
    text in which each trigger starts a tagged structure). `origin` names the request field the constraint
    was built from when that is not its kind's own (a tool call's schema: `tools.parameters`).

    `after_token_id`: the constraint applies to the output after the first such token, the text before it
    being free; None: from the first token. The output processor sets it to a reasoning parser's `</think>`
    for a chat that thinks, as vLLM starts a grammar once the reasoning has ended."""

    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False
    structural_tag: str | None = None
    origin: str = ""
    after_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, dict | bool):  # a schema as Python data: its JSON text
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if isinstance(self.structural_tag, dict):
            object.__setattr__(self, "structural_tag", json.dumps(self.structural_tag))
        if isinstance(self.choice, str):  # one choice, not its characters
            object.__setattr__(self, "choice", (self.choice,))
        elif self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json_schema", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: must be a string, got {value!r}")
        if self.choice is not None and not all(isinstance(c, str) for c in self.choice):
            raise ValueError(f"choice: must be strings, got {list(self.choice)!r}")
        if len(self.kinds) != 1:
            given = ", ".join(self.kinds) or "none"
            raise ValueError(
                f"constraint: give exactly one of json_schema, regex, grammar, choice, "
                f"json_object, structural_tag (got {given})"
            )
        for name, value, check in (
            ("json_schema", self.json_schema, _check_json),
            ("structural_tag", self.structural_tag, _check_structural_tag),
        ):
            if value is not None:
                with nesting_checked(self.origin or name):  # a tool's schema, wrapped deeper by tool_choice
                    check(value)
        for name, value in (("regex", self.regex), ("grammar", self.grammar)):
            if value is not None and not value:
                raise ValueError(f"{name}: must not be empty")
        if self.regex:
            check_regex("regex", self.regex)
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise ValueError("choice: must hold at least one non-empty string")
        after = self.after_token_id
        if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 0):
            raise ValueError(f"after_token_id: must be a token id (an int >= 0) or None, got {after!r}")

    @property
    def kinds(self) -> list[str]:
        values = (
            ("json_schema", self.json_schema is not None),
            ("regex", self.regex is not None),
            ("grammar", self.grammar is not None),
            ("choice", self.choice is not None),
            ("json_object", self.json_object),
            ("structural_tag", self.structural_tag is not None),
        )
        return [name for name, given in values if given]

    @property
    def kind(self) -> str:
        """Which of the kinds this is."""
        return self.kinds[0]

    @property
    def field(self) -> str:
        """The request field the constraint came from; compile errors name it."""
        return self.origin or self.kind

    def writes(self, text: str) -> bool:
        """Whether the constraint's own text (a regex, grammar, structural tag or choice) holds `text`, a
        regex's also with its escapes dropped (`<\\/think>`): a constrained output can then contain it (a
        reasoning parser's `</think>`). Text spelled otherwise (`[<]/think>`, `"</" "think>"`) is not seen."""
        unescaped = None if self.regex is None else re.sub(r"\\(.)", r"\1", self.regex)
        sources = (self.regex, unescaped, self.grammar, self.structural_tag, *(self.choice or ()))
        return any(source is not None and text in source for source in sources)

    def starting_after(self, token_id: int) -> Constraint:
        """This constraint with `after_token_id`: a copy, not validated again (a large schema's check is
        milliseconds)."""
        constraint = copy.copy(self)
        object.__setattr__(constraint, "after_token_id", token_id)
        return constraint

    @property
    def key(self) -> tuple[str, str]:
        """(kind, source): what the core compiles and caches."""
        if self.json_object:
            return ("json_schema", ANY_JSON_OBJECT_SCHEMA)
        if self.choice is not None:
            return ("grammar", choice_grammar(self.choice))
        return (self.kind, self.json_schema or self.regex or self.grammar or self.structural_tag)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose only sentences are the choices (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _check_structural_tag(text: str) -> None:
    """Its shape, and each JSON schema in it as `json_schema` is checked (xgrammar checks the rest)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"structural_tag: is not valid JSON: {e}") from e
    # "type" may be left out, as xgrammar and vLLM take it (SMG's mistral tool parser sends none).
    if not isinstance(value, dict) or value.get("type", "structural_tag") != "structural_tag":
        raise ValueError('structural_tag: must be a JSON object whose "type", if given, is "structural_tag"')
    if "structures" in value:  # the older form
        structures, triggers = value["structures"], value.get("triggers")
        if not isinstance(structures, list) or not structures:
            raise ValueError("structural_tag.structures: must be a non-empty list")
        if (
            not isinstance(triggers, list)
            or not triggers
            or not all(isinstance(t, str) and t for t in triggers)
        ):
            raise ValueError("structural_tag.triggers: must be a non-empty list of non-empty strings")
        for i, structure in enumerate(structures):
            fields = ("begin", "end", "schema")
            if not isinstance(structure, dict) or not all(field in structure for field in fields):
                raise ValueError(f"structural_tag.structures[{i}]: must be an object with begin, schema, end")
            if not all(isinstance(structure[field], str) for field in ("begin", "end")):
                raise ValueError(f"structural_tag.structures[{i}]: begin and end must be strings")
        schemas = [(f"structural_tag.structures[{i}].schema", s["schema"]) for i, s in enumerate(structures)]
    elif isinstance(value.get("format"), dict):
        schemas = list(_format_values(value["format"], "structural_tag.format", "json_schema", "json_schema"))
        for field, pattern in _format_values(value["format"], "structural_tag.format", "regex", "pattern"):
            if isinstance(pattern, str):
                check_regex(field, pattern)
    else:
        raise ValueError('structural_tag: needs a "format" object (or the older "structures" and "triggers")')
    for field, schema in schemas:
        if not isinstance(schema, dict | bool):
            raise ValueError(f"{field}: must be a JSON schema object")
        if (unenforced := unenforced_keyword(schema)) is not None:
            keyword, path, _ = unenforced
            raise ValueError(
                f"{field}: {keyword!r} at {path} is a keyword the grammar cannot enforce (xgrammar), so the "
                f"output could break it; leave it out{unenforced.note}"
            )


def check_regex(field: str, pattern: str) -> None:
    """Refuses a regex (the constraint's `field`) with a part xgrammar drops or misreads (`misread_part`)."""
    if part := misread_part(pattern):
        raise ValueError(f"{field}: the pattern has {part}, so the output could break it")


# The formats of a structural tag that hold a schema or a regex: (type, the key of its value).
_FORMAT_LEAVES = frozenset([("json_schema", "json_schema"), ("regex", "pattern")])


def _format_values(node: object, path: str, kind: str, key: str) -> Iterator[tuple[str, object]]:
    """(field, value) of each `{"type": kind, key: value}` of _FORMAT_LEAVES in a structural tag's format,
    not looking inside the values of any."""
    if isinstance(node, dict):
        if node.get("type") == kind and key in node:
            yield f"{path}.{key}", node[key]
        for name, child in node.items():
            if (node.get("type"), name) not in _FORMAT_LEAVES:
                yield from _format_values(child, f"{path}.{name}", kind, key)
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from _format_values(child, f"{path}[{i}]", kind, key)


def _check_json(schema: str) -> None:
    try:
        value = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema: is not valid JSON: {e}") from e
    if not isinstance(value, dict | bool):
        raise ValueError("json_schema: must be a JSON object")
    if (unenforced := unenforced_keyword(value)) is not None:
        keyword, path, _ = unenforced
        raise ValueError(
            f"json_schema: {keyword!r} at {path} is a keyword the grammar cannot enforce (xgrammar), so the "
            f"output could break it; leave it out{unenforced.note}"
        )


# JSON Schema keywords xgrammar compiles without enforcing them (its warnings say so), so an output that
# breaks them would still be "guaranteed": refused, as vLLM refuses schemas with features xgrammar lacks.
# `oneOf` is compiled as `anyOf`: the same wherever the branches exclude each other (pydantic's tagged
# unions), and documented.
_UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "contains",
    "minContains",
    "maxContains",
)
# Keywords whose values map names to schemas (tool_calls rebases references through them too).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMAS = (
    "additionalProperties",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)


# What xgrammar writes for these keywords given an empty list (JSON Schema: no value matches one): nothing at
# all (`{"x": }` came out, finish_reason "stop"), or any value.
_EMPTY_LISTS_WRITTEN = {"anyOf": "nothing in its place", "oneOf": "nothing in its place", "type": "any value"}


class Unenforced(NamedTuple):
    """A keyword the grammar would not enforce, the JSON pointer of its schema, and why where the keyword
    alone does not say (a pattern's part that xgrammar drops, a number it writes otherwise)."""

    keyword: str
    path: str
    why: str = ""

    @property
    def note(self) -> str:
        """The why, as the end of a message: " (...)", or nothing."""
        return f" ({self.why})" if self.why else ""


def unenforced_keyword(schema: object, path: str = "#") -> Unenforced | None:
    """The first keyword in `schema` or its subschemas that the grammar would not enforce; None if there
    is none."""
    if not isinstance(schema, dict):
        return None
    for keyword in _UNENFORCED:
        if keyword in schema:
            return Unenforced(keyword, path)
    if schema.get("uniqueItems") is True:
        return Unenforced("uniqueItems", path)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return Unenforced("allOf", path)
    for keyword, written in _EMPTY_LISTS_WRITTEN.items():
        if schema.get(keyword) == []:
            why = f"an empty list, which no value matches; xgrammar writes {written}"
            return Unenforced(keyword, path, why)
    if (ignored := _ignored_keyword(schema)) is not None:
        return Unenforced(ignored, path)
    for unwritten in (
        ignored_pattern(schema, reads_pattern="string" in _types(schema)),
        unwritable_number(schema, _types(schema)),
    ):
        if unwritten is not None:
            keyword, why = unwritten
            return Unenforced(keyword, path, why)
    children = [(f"{path}/{k}", schema[k]) for k in _SCHEMAS if k in schema]
    names = schema.get("propertyNames")
    if isinstance(names, dict) and "type" not in names:  # xgrammar reads it as a string's schema, as it is
        children = [(p, {"type": "string", **names} if s is names else s) for p, s in children]
    items = schema.get("items")
    children += [(f"{path}/items/{i}", s) for i, s in enumerate(items)] if isinstance(items, list) else []
    children += [(f"{path}/items", items)] if isinstance(items, dict) else []
    for keyword in SCHEMA_MAPS:
        value = schema.get(keyword)
        children += (
            [(f"{path}/{keyword}/{k}", s) for k, s in value.items()] if isinstance(value, dict) else []
        )
    for keyword in _SCHEMA_LISTS:
        value = schema.get(keyword)
        children += (
            [(f"{path}/{keyword}/{i}", s) for i, s in enumerate(value)] if isinstance(value, list) else []
        )
    return next((found for p, s in children if (found := unenforced_keyword(s, p)) is not None), None)


# The keywords xgrammar reads one of per schema, ignoring the others and every keyword beside it: a `$ref`
# beside `maximum` or a `const` beside another `enum` compiles as the `$ref` or the `const` alone.
_ALTERNATIVES = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_STRING_KEYWORDS = ("pattern", "format", "minLength", "maxLength")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_OBJECT_KEYWORDS = (
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "unevaluatedProperties",
)
_ARRAY_KEYWORDS = ("items", "prefixItems", "additionalItems", "unevaluatedItems", "minItems", "maxItems")
_VALUE_KEYWORDS = ("type", *_STRING_KEYWORDS, *_NUMBER_KEYWORDS, *_OBJECT_KEYWORDS, *_ARRAY_KEYWORDS)
# The string formats xgrammar enforces: beside one, `pattern`, `minLength` and `maxLength` are ignored (beside
# any other format, which it ignores as JSON Schema allows, they hold).
_ENFORCED_FORMATS = frozenset(
    [
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    ]
)
_JSON_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def _ignored_keyword(schema: dict) -> str | None:
    """A keyword of this one schema (not its subschemas) that xgrammar compiles without enforcing where it
    stands: beside another keyword that takes precedence, or where the schema's type leaves it unread."""
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return "$ref"  # a remote reference: xgrammar compiles it as any value
    if not isinstance(schema.get("format", ""), str):
        return "format"  # JSON Schema's format is a string; xgrammar fails on any other
    alternatives = [k for k in _ALTERNATIVES if k in schema]
    if alternatives:
        if len(alternatives) > 1:
            return alternatives[1]
        besides = [k for k in _VALUE_KEYWORDS if k in schema]
        if "type" in besides and (alternatives[0] not in ("const", "enum") or _values_have_its_type(schema)):
            # {"type": "string", "enum": ["a", "b"]}: the type says nothing more. Beside the others it says
            # what their schemas say (vLLM's and SGLang's schema of required tool calls has
            # {"type": "object", "anyOf": [<a call>, ...]}); where it does not, the schema holds no value.
            besides.remove("type")
        return besides[0] if besides else None
    properties, patterns = (
        value if isinstance(value := schema.get(keyword), dict) else {}
        for keyword in ("properties", "patternProperties")
    )
    closed = schema.get("additionalProperties") is False or schema.get("unevaluatedProperties") is False
    if "propertyNames" in schema and (properties or patterns or closed):
        # xgrammar holds only the additional keys' names to it, and writes such keys even where the object
        # is closed to them
        return "propertyNames"
    types = _types(schema)
    if not types:  # typeless: xgrammar reads objects' and arrays' keywords only
        unread = [k for k in (*_STRING_KEYWORDS, *_NUMBER_KEYWORDS) if k in schema]
        return next((k for k in unread if k != "format" or _enforced_format(schema)), None)
    multiple = schema.get("multipleOf")
    if "multipleOf" in schema and (
        "number" in types
        or "integer" not in types
        or not isinstance(multiple, int)
        or isinstance(multiple, bool)
    ):
        return "multipleOf"  # xgrammar enforces whole multiples of integers only
    if "multipleOf" in schema and not _multiple_of_enforced(schema):
        return "multipleOf"
    if "string" in types:
        if _enforced_format(schema):
            return next((k for k in ("pattern", "minLength", "maxLength") if k in schema), None)
        if "pattern" in schema:
            return next((k for k in ("minLength", "maxLength") if k in schema), None)
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list) and any(
        not isinstance(name, str) or name not in (properties if isinstance(properties, dict) else {})
        for name in required
    ):
        return "required"  # a required name without a property schema: xgrammar never writes it
    return None


# xgrammar enforces an integer's whole multipleOf up to this one, without bounds or between a lower and an
# upper bound at most this many integers apart; past them, or beside one bound alone, it drops it
# ("range + multipleOf combination not yet supported; ignoring multipleOf").
_MAX_MULTIPLE_OF = 1024
_MAX_MULTIPLE_OF_RANGE = 10_000


def _multiple_of_enforced(schema: dict) -> bool:
    """Whether xgrammar enforces the whole `multipleOf` of this integer schema, given its bounds (bounds
    that are not numbers are left to xgrammar, which refuses them)."""
    bounds = {
        k: schema[k] for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum") if k in schema
    }
    if not all(isinstance(b, int | float) and not isinstance(b, bool) for b in bounds.values()):
        return True
    if schema["multipleOf"] > _MAX_MULTIPLE_OF:
        return False
    if not bounds:
        return True
    lows = [b + (k == "exclusiveMinimum") for k, b in bounds.items() if k.endswith("inimum")]
    highs = [b - (k == "exclusiveMaximum") for k, b in bounds.items() if k.endswith("aximum")]
    return bool(lows and highs) and math.ceil(min(highs)) - math.floor(max(lows)) < _MAX_MULTIPLE_OF_RANGE


def _enforced_format(schema: dict) -> bool:
    """Whether the schema's "format" is one xgrammar enforces."""
    value = schema.get("format")
    return isinstance(value, str) and value in _ENFORCED_FORMATS


@contextlib.contextmanager
def nesting_checked(field: str) -> Iterator[None]:
    """JSON nested deeper than Python's parser or our walks recurse is a bad request naming `field`,
    not an internal error (RecursionError)."""
    try:
        yield
    except RecursionError as e:
        raise ValueError(f"{field}: nests too deeply") from e


def _types(schema: dict) -> list[str]:
    """The schema's "type", as a list (empty without one)."""
    value = schema.get("type")
    if isinstance(value, list):
        return [t for t in value if isinstance(t, str)]
    return [value] if isinstance(value, str) else []


def _values_have_its_type(schema: dict) -> bool:
    """Whether a schema with `const` or `enum` has a "type" that each of those values has."""
    values = [schema["const"]] if "const" in schema else schema["enum"]
    types = _types(schema)
    return isinstance(values, list) and all(
        any(t in _JSON_TYPES and _JSON_TYPES[t](v) for t in types) for v in values
    )
