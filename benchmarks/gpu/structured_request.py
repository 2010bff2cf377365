"""The JSON schema of the GPU check's constrained request, and the check of an answer against it.

Every property is bounded (an integer range, a boolean, an enum), so even a random-weight model's
constrained output ends in a few tokens. Answers are validated with `jsonschema` where it is installed
(the CPU machines); the GPU image has no `jsonschema`, so there the same rules are checked by hand.
"""

from __future__ import annotations

from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "paid": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["id", "paid", "color"],
    "additionalProperties": False,
}


def schema_errors(value: Any) -> list[str]:
    """Why `value` does not match SCHEMA; empty when it does."""
    try:
        import jsonschema
    except ImportError:
        return _errors_by_hand(value)
    return [error.message for error in jsonschema.Draft202012Validator(SCHEMA).iter_errors(value)]


def _errors_by_hand(value: Any) -> list[str]:
    if not isinstance(value, dict):
        return [f"{value!r} is not of type 'object'"]
    errors = [f"{key!r} is a required property" for key in SCHEMA["required"] if key not in value]
    errors += [f"additional property {key!r}" for key in value if key not in SCHEMA["properties"]]
    number = value.get("id")
    if "id" in value and (type(number) is not int or not 0 <= number <= 999):
        errors.append(f"id: {number!r} is not an integer in [0, 999]")
    if "paid" in value and type(value["paid"]) is not bool:
        errors.append(f"paid: {value['paid']!r} is not of type 'boolean'")
    if "color" in value and value["color"] not in SCHEMA["properties"]["color"]["enum"]:
        errors.append(f"color: {value['color']!r} is not one of the enum")
    return errors
