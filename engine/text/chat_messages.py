"""A conversation as chat templates take it: the messages a caller sends (over gRPC, or to `LLM.chat`),
checked, with their tool calls in the form transformers documents for templates.

A tool call may come as Sluice returns it, {"id", "name", "arguments"}, or as OpenAI clients send it,
{"id", "type": "function", "function": {"name", "arguments"}}, its arguments a JSON object or its text.
Templates get {"id", "type": "function", "function": {"name", "arguments": <the object>}}: they print
`arguments | tojson`, so text would be printed as a quoted string (vLLM parses it for them likewise). An
assistant message's empty content beside its tool calls is left out, as transformers leaves out the null
content OpenAI clients send there (some templates refuse content and calls in one message; one that
reads every message's content gets "" there, as vLLM gives it: `ChatTemplate.render`). Content given as
OpenAI's text parts becomes their text, joined by newlines (vLLM's "string" content format).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from sluice.engine.errors import InvalidRequestError

# A surrogate in a str parsed from JSON: a lone one (the escape "\\ud83d" alone; a pair's halves are
# joined). A template prints it as a character no UTF-8 text holds, and the tokenizer fails on it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """`messages` checked (InvalidRequestError naming the field) and in the templates' form."""
    return [_message(index, message) for index, message in enumerate(messages)]


def _message(index: int, message: Any) -> dict[str, Any]:
    field = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidRequestError(field, f"must be a mapping with role and content, got {message!r}")
    if not message.get("role"):
        raise InvalidRequestError(f"{field}.role", "must not be empty")
    converted = dict(message)
    content = message.get("content")
    if isinstance(content, Sequence) and not isinstance(content, str | bytes):
        converted["content"] = _text_of_parts(f"{field}.content", content)
    tool_calls = message.get("tool_calls")
    if tool_calls is None:
        return converted
    if isinstance(tool_calls, str | bytes | Mapping) or not isinstance(tool_calls, Sequence):
        raise InvalidRequestError(f"{field}.tool_calls", f"must be a list of calls, got {tool_calls!r}")
    converted["tool_calls"] = [_tool_call(f"{field}.tool_calls[{i}]", c) for i, c in enumerate(tool_calls)]
    if converted["tool_calls"] and not converted.get("content"):
        converted.pop("content", None)
    return converted


def _text_of_parts(field: str, parts: Sequence[Any]) -> str:
    """OpenAI's content parts, [{"type": "text", "text": ...}, ...], as the one string text templates
    take (joined by newlines, as vLLM joins them for such templates); a part of another type is refused."""
    texts = []
    for i, part in enumerate(parts):
        if (
            not isinstance(part, Mapping)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise InvalidRequestError(
                f"{field}[{i}]", f"must be a text part {{'type': 'text', 'text': ...}}, got {part!r}"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_call(field: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise InvalidRequestError(field, f"must be a mapping with name and arguments, got {call!r}")
    function = call
    if "function" in call:
        field, function = f"{field}.function", call["function"]
        if not isinstance(function, Mapping):
            raise InvalidRequestError(field, f"must be a mapping with name and arguments, got {function!r}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{field}.name", f"must be a function's name, got {name!r}")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=refuse_json_constant)
        except (ValueError, RecursionError) as e:
            raise InvalidRequestError(f"{field}.arguments", f"is not valid JSON: {e}") from e
    if not isinstance(arguments, Mapping):
        raise InvalidRequestError(f"{field}.arguments", f"must be a JSON object, got {arguments!r}")
    if not _finite(dict(arguments)):  # 1e999 reads as infinity, which the template prints as Infinity
        raise InvalidRequestError(f"{field}.arguments", "holds NaN or a number past a float's range")
    if (error := lone_surrogate_error(f"{field}.arguments", json_text(arguments))) is not None:
        raise error
    converted = {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
    return {"id": call["id"], **converted} if call.get("id") else converted


def _finite(value: Any) -> bool:
    """Whether `value` holds no infinite or NaN float (a value that is no JSON at all, a cycle, is left to
    the template's `tojson`)."""
    try:
        text = json.dumps(value, default=str)  # such a float comes out as Infinity or NaN
    except (ValueError, RecursionError):
        return True
    try:
        json.loads(text, parse_constant=refuse_json_constant)
    except ValueError:
        return False
    except RecursionError:
        return True
    return True


def refuse_json_constant(name: str) -> None:
    """json's `parse_constant`: Python's json takes NaN and Infinity, which JSON has not (a template would
    print them as they are; Go, Java and JavaScript clients could not parse them)."""
    raise ValueError(f"{name} is not a JSON number")


def json_text(value: Any) -> str:
    """`value` as JSON text with its characters unescaped (surrogates included); "" for a value that is no
    JSON (a cycle, too deep), which the template's `tojson` refuses in its own words."""
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (ValueError, RecursionError):
        return ""


def lone_surrogate_error(field: str, text: str) -> InvalidRequestError | None:
    """The error naming `field` for the first lone surrogate in `text`; None if it holds none."""
    if (lone := LONE_SURROGATE.search(text)) is None:
        return None
    return InvalidRequestError(
        field, f"holds a lone surrogate (\\u{ord(lone[0]):04x}), which a prompt's UTF-8 text cannot hold"
    )
