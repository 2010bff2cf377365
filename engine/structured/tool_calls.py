"""Tool calls: the tools of a chat request, the constraint that enforces a required or named call, and
the calls parsed from the finished output. Pure Python: the frontend uses it.

    tool_choice   rendered tools   constraint on the output                     parsed from the output
    none          yes              none                                         nothing
    auto          yes              none                                         <tool_call>{...}</tool_call>
                                                                                blocks, or the whole text
                                                                                when it is such JSON
    required      yes              [{"name": <a tool>, "arguments": {...}}, ...] every call of the array
    a function    yes              that function's arguments object             one call of it

The tools reach the chat template as transformers' `apply_chat_template(tools=...)` passes JSON-schema
tools: {"type": "function", "function": {"name", "description", "parameters"}}.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from sluice.engine.errors import InvalidRequestError
from sluice.engine.outputs import ToolCall
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint

TOOL_CHOICE_MODES = ("none", "auto", "required")
NO_ARGUMENTS_SCHEMA = {"type": "object", "properties": {}}
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is the JSON schema of its arguments, as JSON text."""

    name: str
    description: str = ""
    parameters: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tools.name: must not be empty")
        if self.parameters:
            try:
                schema = json.loads(self.parameters)
            except json.JSONDecodeError as e:
                raise ValueError(f"tools.parameters: {self.name!r} is not valid JSON: {e}") from e
            if not isinstance(schema, dict):
                raise ValueError(f"tools.parameters: {self.name!r} must be a JSON object")

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.parameters) if self.parameters else dict(NO_ARGUMENTS_SCHEMA)

    def for_template(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.schema}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """The tools of one chat request and `tool_choice`: "none", "auto", "required" or a tool's name."""

    tools: tuple[Tool, ...]
    tool_choice: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        names = [tool.name for tool in self.tools]
        if not names:
            raise ValueError("tools: must not be empty when tool_choice is given")
        if len(set(names)) != len(names):
            raise ValueError("tools: names must be unique")
        if self.tool_choice not in TOOL_CHOICE_MODES and self.tool_choice not in names:
            raise ValueError(f"tool_choice: {self.tool_choice!r} is not a mode nor one of the tools {names}")

    def for_template(self) -> list[dict[str, Any]]:
        return [tool.for_template() for tool in self.tools]

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the constraint that enforces a required or named call."""
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
        if self.tool_choice in ("none", "auto"):
            return None
        if self.tool_choice != "required":
            return Constraint(json_schema=json.dumps(self._tool(self.tool_choice).schema))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"enum": [tool.name]}, "arguments": tool.schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        return Constraint(json_schema=json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": calls}}))

    def parse(self, text: str) -> tuple[ToolCall, ...]:
        """The calls in a finished output; () when there are none or they do not parse."""
        if self.tool_choice == "none":
            return ()
        if self.tool_choice not in TOOL_CHOICE_MODES:
            arguments = _loads(text)
            return () if not isinstance(arguments, dict) else (ToolCall(self.tool_choice, _dumps(arguments)),)
        blocks = _TOOL_CALL_BLOCK.findall(text) if self.tool_choice == "auto" else []
        values = [_loads(block) for block in blocks] or [_loads(text)]
        calls = [call for value in values for call in (value if isinstance(value, list) else [value])]
        return tuple(tc for tc in (self._call(c) for c in calls) if tc is not None)

    def _call(self, value: Any) -> ToolCall | None:
        if not isinstance(value, dict) or value.get("name") not in {t.name for t in self.tools}:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        return ToolCall(value["name"], _dumps(arguments)) if isinstance(arguments, dict) else None

    def _tool(self, name: str) -> Tool:
        return next(tool for tool in self.tools if tool.name == name)


def _loads(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return None


def _dumps(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)
