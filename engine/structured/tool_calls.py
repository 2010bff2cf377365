"""Tool calls: the tools of a chat request, the constraint that enforces a required or named call, and
the calls parsed from the finished output. Pure Python: the frontend uses it (xgrammar imports torch).

    tool_choice   rendered tools   constraint on the output                     parsed from the output
    none          yes              none                                         nothing
    auto          yes              none                                         <tool_call>{...}</tool_call>
                                                                                blocks, or the whole text
                                                                                when it is such JSON (after
                                                                                [TOOL_CALLS] or
                                                                                <|python_tag|>; ';' apart)
    required      yes              [{"name": <a tool>, "arguments": {...}}, ...] every call of the array
    a function    yes              that function's arguments object             one call of it

Each parsed call gets an id of 9 letters and digits (Mistral's templates refuse any other length), which
the next turn's messages give back: the assistant's `tool_calls` and each result's `tool_call_id`. The
`content` beside the calls is what auto's output says outside the <tool_call> blocks that parsed into
calls (a block that did not, e.g. arguments that are not JSON, stays in it); the other modes' outputs are
only calls.

The tools reach the chat template as transformers' `apply_chat_template(tools=...)` passes JSON-schema
tools: {"type": "function", "function": {"name", "description", "parameters"}} (the parameters' keys in the
caller's order; a tool without a description has "" for it, which the proto cannot tell from none, and
templates that print `tool.description` need: Hermes'). A tool's parameters
describe an object: a schema without "type" gets "type": "object" (as vLLM gives empty parameters
{"type": "object", "properties": {}}), another "type" is refused, and so is a keyword the grammar
cannot enforce (`constraint.unenforced_keyword`), when the Tool is built, whatever the tool_choice; a
schema xgrammar cannot compile fails a required or named call's constraint (json_schema). Calls whose
arguments hold NaN or Infinity are dropped: JSON has no such numbers, and Go, Java and JavaScript clients
could not parse them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.engine.errors import InvalidRequestError
from sluice.engine.outputs import ToolCall
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import SCHEMA_MAPS, Constraint, nesting_checked, unenforced_keyword
from sluice.engine.text.chat_messages import LONE_SURROGATE, refuse_json_constant

TOOL_CHOICE_MODES = ("none", "auto", "required")
NO_ARGUMENTS_SCHEMA = {"type": "object", "properties": {}}
# The field a required or named call's grammar comes from: its errors name it.
_PARAMETERS = "tools.parameters"
# The last block may be unclosed: a stop string "</tool_call>" or EOS ended the output after its JSON.
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
# What opens the calls of Mistral's ([TOOL_CALLS]) and Llama 3.1's (<|python_tag|>) outputs, where vLLM's
# mistral and llama3_json parsers split them: special tokens, in the text since auto keeps them.
_CALL_MARKERS = re.compile(r"\[TOOL_CALLS\]|<\|python_tag\|>")
_MISTRAL_V11_CALL = re.compile(r"\s*([\w.-]+)\[ARGS\](.*)", re.DOTALL)  # [TOOL_CALLS]name[ARGS]{...}
# Keywords whose values are data, not schemas.
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))
_CALL_ID_CHARACTERS = string.ascii_letters + string.digits
CALL_ID_LENGTH = 9


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is the JSON schema of its arguments, as JSON text (or a
    dict, kept as its JSON text)."""

    name: str
    description: str = ""
    parameters: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tools.name: must not be empty")
        if isinstance(self.parameters, Mapping):  # a schema object, as OpenAI clients send it
            object.__setattr__(self, "parameters", json.dumps(self.parameters))
        elif not isinstance(self.parameters, str):
            raise ValueError(f"tools.parameters: {self.name!r} must be a JSON schema (text or a dict)")
        if self.parameters:
            with nesting_checked("tools.parameters"):
                self._check_parameters()

    def _check_parameters(self) -> None:
        try:
            schema = json.loads(self.parameters)
        except json.JSONDecodeError as e:
            raise ValueError(f"tools.parameters: {self.name!r} is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise ValueError(f"tools.parameters: {self.name!r} must be a JSON object")
        if schema.get("type", "object") != "object":
            got = json.dumps(schema["type"])
            raise ValueError(f'tools.parameters: {self.name!r} must have "type": "object", got {got}')
        if (unenforced := unenforced_keyword(schema)) is not None:
            keyword, path, _ = unenforced
            raise ValueError(
                f"tools.parameters: {self.name!r} has {keyword!r} at {path}, a keyword the grammar "
                f"cannot enforce; leave it out{unenforced.note}"
            )

    @property
    def schema(self) -> dict[str, Any]:
        """The arguments' JSON schema: always of an object (its keys in the caller's order)."""
        if not self.parameters:
            return dict(NO_ARGUMENTS_SCHEMA)
        schema = json.loads(self.parameters)
        return schema if "type" in schema else {"type": "object", **schema}

    def for_template(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.schema}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """The tools of one chat request and `tool_choice`: "none", "auto", "required" or a tool's name.
    `named` says that tool_choice is a tool's name even where it is spelled like a mode (the proto's
    `function_name`: a tool may be called "none")."""

    tools: tuple[Tool, ...]
    tool_choice: str = "auto"
    named: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        names = [tool.name for tool in self.tools]
        if not names:
            raise ValueError("tools: must not be empty when tool_choice is given")
        if len(set(names)) != len(names):
            raise ValueError("tools: names must be unique")
        if self.named and self.tool_choice not in names:
            name = self.tool_choice
            raise ValueError(f"tool_choice.function_name: {name!r} is not one of the tools {names}")
        if self.mode == "function" and self.tool_choice not in names:
            raise ValueError(f"tool_choice: {self.tool_choice!r} is not a mode nor one of the tools {names}")

    @property
    def mode(self) -> str:
        """The mode: "none", "auto", "required", or "function" (a call of the tool tool_choice names)."""
        return "function" if self.named or self.tool_choice not in TOOL_CHOICE_MODES else self.tool_choice

    def for_template(self) -> list[dict[str, Any]]:
        return [tool.for_template() for tool in self.tools]

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the constraint that enforces a required or named call. Auto keeps special tokens
        in the text, where the calls parse from: the <tool_call> tags are special tokens in some
        tokenizers (Hermes-style checkpoints; vLLM's Hermes parser turns skip_special_tokens off too),
        unless a constraint of the request's own holds the output, which then has no special token."""
        if self.mode == "auto" and params.constraint is None and params.skip_special_tokens:
            return dataclasses.replace(params, skip_special_tokens=False)
        constraint = self.constraint()
        if constraint is None:
            return params
        if params.constraint is not None:
            raise InvalidRequestError(
                "tool_choice", f"{self.tool_choice!r} cannot be combined with a constraint"
            )
        return dataclasses.replace(params, constraint=constraint)

    def constraint(self) -> Constraint | None:
        """What the output must match: None for "none" and "auto"."""
        if self.mode in ("none", "auto"):
            return None
        if self.mode == "function":
            return Constraint(json_schema=json.dumps(self._tool(self.tool_choice).schema), origin=_PARAMETERS)
        # Each tool's schema sits under the root's $defs, its own "#/..." references rebased to follow it.
        defs = {f"tool_{i}": _rebased(tool.schema, f"#/$defs/tool_{i}") for i, tool in enumerate(self.tools)}
        calls = [
            {
                "type": "object",
                "properties": {"name": {"enum": [tool.name]}, "arguments": {"$ref": f"#/$defs/tool_{i}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i, tool in enumerate(self.tools)
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
        return Constraint(json_schema=json.dumps(schema), origin=_PARAMETERS)

    def parse(self, text: str) -> tuple[ToolCall, ...]:
        """The calls in a finished output; () when there are none or they do not parse."""
        if self.mode == "none":
            return ()
        if self.mode == "function":
            arguments = _arguments_text(_loads(text))
            return () if arguments is None else (ToolCall(self.tool_choice, arguments, new_call_id()),)
        # An output that is JSON of calls as a whole (required's array) is taken as such first: a marker or
        # a <tool_call> tag inside one of its strings is an argument's text, not where calls start.
        if (whole := self._block_calls(text)) is not None:
            return whole
        blocks = _TOOL_CALL_BLOCK.findall(text) if self.mode == "auto" else []
        if not blocks:
            return self._whole_output_calls(text) or ()
        return tuple(call for block in blocks for call in self._block_calls(block) or ())

    def _whole_output_calls(self, text: str) -> tuple[ToolCall, ...] | None:
        """The calls of an output that is only calls: JSON of a call or a list of them, calls apart by
        ';' (Llama 3.1), each after Mistral's or Llama's marker where it has one (Mistral v11's
        name[ARGS]{...} too). None unless every part is calls of the tools, or with text before a marker."""
        before, *segments = _CALL_MARKERS.split(text)
        if segments and before.strip():
            return None
        calls: list[ToolCall] = []
        for segment in segments or [before]:
            if v11 := _MISTRAL_V11_CALL.fullmatch(segment):
                call = self._call({"name": v11[1], "arguments": _loads(v11[2])})
                found = None if call is None else (call,)
            else:
                found = self._block_calls(segment)
            if found is None:
                return None
            calls += found
        return tuple(calls) or None

    def content(self, text: str) -> str:
        """What a finished output with calls says besides them: auto's text outside the <tool_call>
        blocks it parsed into calls, stripped (a block that is not JSON of calls of the tools stays, as
        the model wrote it); "" for an output that is only a call (every mode's but auto's)."""
        if self.mode != "auto" or not _TOOL_CALL_BLOCK.search(text) or self._block_calls(text) is not None:
            return ""
        return _TOOL_CALL_BLOCK.sub(lambda m: "" if self._block_calls(m[1]) else m[0], text).strip()

    def _block_calls(self, block: str) -> tuple[ToolCall, ...] | None:
        """The calls of one <tool_call> block or of a whole output (JSON of a call or a list of them, or
        calls apart by ';'); None unless each is a call of one of the tools."""
        values = _json_values(block)
        if values is None:
            return None
        calls = [self._call(c) for value in values for c in (value if isinstance(value, list) else [value])]
        return tuple(calls) if calls and None not in calls else None

    def _call(self, value: Any) -> ToolCall | None:
        if not isinstance(value, dict):
            return None
        name = value.get("name")  # any JSON value the model wrote: a list or an object is no tool's name
        if not isinstance(name, str) or name not in {t.name for t in self.tools}:
            return None
        arguments = _arguments_text(value.get("arguments", value.get("parameters", {})))
        return None if arguments is None else ToolCall(value["name"], arguments, new_call_id())

    def _tool(self, name: str) -> Tool:
        return next(tool for tool in self.tools if tool.name == name)


def new_call_id() -> str:
    return "".join(secrets.choice(_CALL_ID_CHARACTERS) for _ in range(CALL_ID_LENGTH))


def _loads(text: str) -> Any:
    """The JSON value of `text`; None when it is not JSON, holds NaN or Infinity, or nests too deep for
    the parser (a model's output can: RecursionError)."""
    try:
        return json.loads(text.strip(), parse_constant=refuse_json_constant)
    except (ValueError, RecursionError):
        return None


def _json_values(text: str) -> list[Any] | None:
    """The JSON values of `text`, one or several apart by ';' (Llama 3.1's parallel calls); None unless
    all of it is such values (as `_loads`: no NaN or Infinity, not nested too deep)."""
    decoder = json.JSONDecoder(parse_constant=refuse_json_constant)
    values, text, at = [], text.strip(), 0
    try:
        while True:
            value, at = decoder.raw_decode(text, at)
            values.append(value)
            rest = text[at:].lstrip()
            if not rest:
                return values
            if not rest.startswith(";"):
                return None
            at = len(text) - len(rest[1:].lstrip())
    except (ValueError, RecursionError):
        return None


def _arguments_text(arguments: Any) -> str | None:
    """`arguments` as JSON text; None unless an object of finite numbers (1e999 parses as infinity). A lone
    surrogate the model wrote as an escape ("\\ud83d", JSON text no UTF-8 can hold as a character) stays
    an escape: the text goes out in protobuf strings, which are UTF-8."""
    if not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None
    return LONE_SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def _rebased(node: Any, base: str) -> Any:
    """A schema moved to the JSON pointer `base`, its local references ("#", "#/...") made to follow it."""
    if isinstance(node, list):
        return [_rebased(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    rebased = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            rebased[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            rebased[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            rebased[key] = {name: _rebased(schema, base) for name, schema in value.items()}
        else:
            rebased[key] = _rebased(value, base)
    return rebased
