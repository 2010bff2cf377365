"""Typed reads of a parsed `config.json`'s fields: a value of the wrong type or out of range is refused with a
ValueError naming the field, before it reaches a tensor shape (where "got str" or a negative dimension would
name nothing) or a truth test (where the string "false" is true)."""

from __future__ import annotations

import math
from typing import Any

_MISSING = object()


def positive_int(config: dict[str, Any], key: str, default: Any = _MISSING, prefix: str = "") -> int:
    """config[key], an integer >= 1; `default` where the key is absent or null (without a default, absent
    is refused). `prefix` goes before the key in messages ("rope_scaling." for a nested field)."""
    value = _read(config, key, default, prefix)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{prefix}{key}: must be an integer >= 1, got {value!r}")
    return value


def positive_float(config: dict[str, Any], key: str, default: Any = _MISSING, prefix: str = "") -> float:
    """config[key], a finite number > 0 (an integer too), as a float; `default` as in `positive_int`."""
    value = _read(config, key, default, prefix)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{prefix}{key}: must be a number > 0, got {value!r}")
    return float(value)


def flag(config: dict[str, Any], key: str, default: bool) -> bool:
    """config[key], true or false (JSON's); `default` where the key is absent or null."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key}: must be true or false, got {value!r}")
    return value


def _read(config: dict[str, Any], key: str, default: Any, prefix: str) -> Any:
    value = config.get(key)
    if value is not None:
        return value
    if default is _MISSING:
        raise ValueError(f"{prefix}{key}: missing from the model's config.json")
    return default
