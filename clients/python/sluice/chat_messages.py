"""Chat messages, tools, tool calls and tool_choice as Python values <-> their proto messages.

A conversation is a list of dicts, as OpenAI's client takes them:

    {"role": "user", "content": "Weather in Paris?"}
    {"role": "assistant", "content": "", "tool_calls": [{"id", "name", "arguments"}]}   # as_message()
    {"role": "tool", "tool_call_id": "Xk3f9QbZ1", "name": "get_weather", "content": "18 C"}

A tool call may also be OpenAI's {"id", "type", "function": {"name", "arguments"}} or a `pb.ToolCall`; a
tool {"name", "description", "parameters"}, OpenAI's {"type": "function", "function": {...}} or a
`pb.Tool`. Arguments and parameters are JSON text or a JSON value (sent as its text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sluice.v1 import sluice_pb2 as pb

Tools = Sequence[pb.Tool | Mapping[str, Any]]
# The names a message's reasoning goes by, in the server's order (sluice.engine.text.chat_template).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
TOOL_CHOICE_MODES = {
    "none": pb.TOOL_CHOICE_MODE_NONE,
    "auto": pb.TOOL_CHOICE_MODE_AUTO,
    "required": pb.TOOL_CHOICE_MODE_REQUIRED,
}


def chat_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Tools | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | None = None,
) -> pb.ChatMessages:
    """Messages as dicts: "role", "content" (None for none), and for a tool-using turn "tool_calls" (an
    assistant's: `Completion.as_message()`'s {"id", "name", "arguments"}, OpenAI's {"id", "type",
    "function": {"name", "arguments"}} or `pb.ToolCall`s), "tool_call_id" and "name" (a tool's result).
    `tools`: `pb.Tool`s or dicts, {"name", "description", "parameters"} or OpenAI's {"type": "function",
    "function": {...}}, parameters a JSON schema or its text; `tool_choice`: "none", "auto", "required",
    a tool's name, or OpenAI's {"type": "function", "function": {"name"}} (a tool's name even when it is
    spelled like a mode) (unset: auto). As vLLM's chat API: `chat_template_kwargs`, extra variables for the
    chat template (JSON values, e.g. {"enable_thinking": False}); `add_generation_prompt` (None: the
    server's default, true); `continue_final_message`, the prompt ends inside the last (assistant) message."""
    checked_flag("add_generation_prompt", add_generation_prompt)
    checked_flag("continue_final_message", continue_final_message)
    chat = pb.ChatMessages(
        messages=[chat_message(message) for message in messages],
        tools=[tool(t) for t in tools or ()],
        continue_final_message=bool(continue_final_message),
    )
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(
                f"tool_choice: as a dict, {{'type': 'function', 'function': {{'name'}}}}; got {tool_choice!r}"
            )
        chat.tool_choice.function_name = function["name"]
    elif tool_choice in TOOL_CHOICE_MODES:
        chat.tool_choice.mode = TOOL_CHOICE_MODES[tool_choice]
    elif tool_choice is not None:
        chat.tool_choice.function_name = tool_choice
    if chat_template_kwargs:
        chat.chat_template_kwargs.update(chat_template_kwargs)
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


def checked_flag(name: str, value: object) -> bool | None:
    """`value`, a bool or None (None: unset); a ValueError naming it otherwise (bool("false") is True)."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}: must be True or False, got {value!r}")
    return value


def check_chat_fields(messages: Sequence[Mapping[str, Any]] | None, **fields: object) -> None:
    """Raises ValueError naming the first of `fields` given (not None) without messages: only a chat has
    tools, a tool_choice and chat template options."""
    given = next((name for name, value in fields.items() if value is not None), None)
    if messages is None and given is not None:
        raise ValueError(f"{given}: needs messages")


def chat_message(message: Mapping[str, Any]) -> pb.ChatMessage:
    """One message dict as a `pb.ChatMessage`; OpenAI's text content parts are joined by newlines, as the
    server joins them for text templates."""
    # A missing role failed with KeyError 'role'; an empty one is the server's to refuse, naming the index.
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"messages: each must be a mapping with a role and content, got {message!r}")
    content = message.get("content") or ""
    if not isinstance(content, str):
        parts = content if isinstance(content, Sequence) else [content]
        if not all(_is_text_part(part) for part in parts):
            raise ValueError(f"messages: content must be a string or text parts, got {content!r}")
        content = "\n".join(part["text"] for part in parts)
    # Its reasoning under any name the server's templates read it by (it was dropped): the first given.
    reasoning = next((message[name] for name in REASONING_FIELDS if message.get(name) is not None), "")
    if not isinstance(reasoning, str):
        raise ValueError(f"messages: reasoning must be a string, got {reasoning!r}")
    return pb.ChatMessage(
        role=message["role"],
        content=content,
        tool_calls=[tool_call(call) for call in message.get("tool_calls") or ()],
        tool_call_id=message.get("tool_call_id") or "",
        name=message.get("name") or "",
        reasoning_content=reasoning,
    )


def _is_text_part(part: object) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)


def tool(tool: pb.Tool | Mapping[str, Any]) -> pb.Tool:
    """A tool in either dict form (or a `pb.Tool`, as it is) as a `pb.Tool`."""
    if isinstance(tool, pb.Tool):
        return tool
    function, parameters = _function_and_json_text(tool, "parameters", "tools")
    return pb.Tool(
        name=function["name"], description=function.get("description") or "", parameters=parameters
    )


def tool_call(call: pb.ToolCall | Mapping[str, Any]) -> pb.ToolCall:
    """A tool call in either dict form (or a `pb.ToolCall`, as it is) as a `pb.ToolCall`."""
    if isinstance(call, pb.ToolCall):
        return call
    function, arguments = _function_and_json_text(call, "arguments", "tool_calls")
    return pb.ToolCall(id=call.get("id") or "", name=function["name"], arguments=arguments)


def assistant_message(
    text: str, content: str, tool_calls: Sequence[pb.ToolCall], reasoning: str = ""
) -> dict[str, Any]:
    """The assistant message of a generation, to send back as the conversation's next turn: its `text`,
    or with `tool_calls` those calls as dicts and the `content` beside them; its `reasoning` (a server
    running a reasoning parser) as "reasoning_content", which the chat template keeps or drops."""
    message: dict[str, Any] = {"role": "assistant", "content": content if tool_calls else text}
    if tool_calls:
        message["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in tool_calls]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _function_and_json_text(entry: Mapping[str, Any], key: str, field: str) -> tuple[Mapping[str, Any], str]:
    """A tool's or a call's fields (OpenAI's form wraps them in "function") and its `key` as JSON text
    (given as a JSON value or as its text). One without a name failed with KeyError 'name'."""
    function = entry.get("function", entry) if isinstance(entry, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{field}: each must be a mapping with a string name (or OpenAI's under 'function')")
    value = function.get(key) or ""
    return function, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
