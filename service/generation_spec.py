"""A generation request as the engine takes it, whichever API it came through (sluice.v1 or SMG's
vllm.grpc.engine): the pure conversions of each API build one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.tool_calls import ToolUse
from sluice.engine.text.chat_template import ChatTemplateOptions


@dataclass(frozen=True)
class Prompt:
    """The prompt of a request in the keyword form `AsyncEngine.add_request` takes; `chat_options` (with
    `messages` only): how the chat template renders them (None: the defaults)."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    chat_options: ChatTemplateOptions | None = None

    def as_kwargs(self) -> dict[str, object]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "messages": self.messages,
            "chat_options": self.chat_options,
        }

    @property
    def operation(self) -> str:
        """The gen_ai.operation.name of a request with this prompt."""
        return "chat" if self.messages is not None else "text_completion"


@dataclass(frozen=True)
class GenerationSpec:
    """`timeout` None is none; `stream_interval` None is the server's default; `trace_context` holds
    the request's own traceparent/tracestate (empty: the call's metadata is the parent)."""

    prompt: Prompt
    params: SamplingParams
    tool_use: ToolUse | None = None
    timeout: float | None = None
    priority: int = 0
    cache_salt: str = ""
    stream_interval: int | None = None
    use_speculation: bool = True
    trace_context: Mapping[str, str] = field(default_factory=dict)
