"""The numbers of a JSON schema that xgrammar cannot write as the schema means them.

xgrammar writes a `number` between two bounds with at most 6 decimal places: where none lies between them
(`minimum` 1e-7 and `maximum` 2e-7) its rule is the empty string, and the output holds no value at all
(`{"x": }`). It holds `const` and `enum` values and a `number`'s bounds as doubles: an integer past 2^53
that no double holds comes out rounded (a `const` of 12345678901234567890 as 1.2345678901234567e+19, a
`minimum` of 2^53 + 1 lets 2^53 through; an `integer`'s bounds it holds exactly). `unwritable_number`
names such a keyword, so that the schema is refused rather than compiled to what it does not mean.
"""

from __future__ import annotations

import math
from decimal import Decimal

_STEP = Decimal("0.000001")  # the finest a number xgrammar writes between two bounds
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")


def unwritable_number(schema: dict, types: list[str]) -> tuple[str, str] | None:
    """(keyword, why) of a number of this one schema that xgrammar would write otherwise than the schema
    means; None if there is none. `types`: the schema's "type", as a list."""
    for keyword in ("const", "enum"):
        if keyword in schema and (integer := _integer_no_double_holds(schema[keyword])) is not None:
            return keyword, _written(integer)
    if "number" not in types:
        return None
    bounds = {k: b for k in (*_LOWER, *_UPPER) if _is_number(b := schema.get(k))}
    for keyword, bound in bounds.items():
        if isinstance(bound, int) and _integer_no_double_holds(bound) is not None:
            return keyword, _written(bound)
    lowers = [(k, b) for k, b in bounds.items() if k in _LOWER]
    uppers = [(k, b) for k, b in bounds.items() if k in _UPPER]
    if not lowers or not uppers:
        return None
    least = max(_least_written_above(Decimal(repr(b)), k == "exclusiveMinimum") for k, b in lowers)
    if all(least < Decimal(repr(b)) or (k == "maximum" and least == Decimal(repr(b))) for k, b in uppers):
        return None
    keyword = lowers[0][0]
    return keyword, (
        "no number of at most 6 decimal places lies within the bounds, and xgrammar writes no other: "
        "the output would hold no value"
    )


def _least_written_above(bound: Decimal, exclusive: bool) -> Decimal:
    """The least number of at most 6 decimal places at or above `bound` (above it, if `exclusive`)."""
    steps = math.ceil(bound / _STEP)
    if exclusive and steps * _STEP == bound:
        steps += 1
    return steps * _STEP


def _integer_no_double_holds(value: object) -> int | None:
    """The first integer in `value` (a JSON value: lists and objects searched) that no double holds."""
    if isinstance(value, list | dict):
        children = value.values() if isinstance(value, dict) else value
        return next((i for child in children if (i := _integer_no_double_holds(child)) is not None), None)
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    try:
        return None if int(float(value)) == value else value
    except OverflowError:
        return value


def _written(integer: int) -> str:
    """What xgrammar makes of an integer no double holds."""
    try:
        return f"no double holds {integer}; xgrammar writes it as {float(integer)!r}"
    except OverflowError:
        return f"no double holds {integer}, past the largest; xgrammar cannot write it"


def _is_number(value: object) -> bool:
    """A JSON number Python can reason about: not a bool, nor json's NaN or Infinity (left to xgrammar)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
