"""A checkpoint's JSON files (config.json, generation_config.json, tokenizer_config.json, ...) read as
objects: one that is not is refused naming the file (json's own error named neither it nor the model). A
leaf module: loading and text both read such files."""

from __future__ import annotations

import json
import os
from typing import Any


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in the file at `path`; ValueError naming the file when it holds none."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model: {os.fspath(path)!r} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"model: {os.fspath(path)!r} must hold a JSON object, got {type(value).__name__}")
    return value
