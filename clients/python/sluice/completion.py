"""`Completion`: a whole generation (one sample of it) collected from the chunks of its stream."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sluice.chat_messages import assistant_message
from sluice.v1 import sluice_pb2 as pb


@dataclass
class Completion:
    """A whole generation (one sample of it), collected from its chunks."""

    request_id: str = ""
    index: int = 0  # which of the request's n samples
    text: str = ""  # with a server's reasoning parser, a chat's content: the output after its think block
    reasoning: str = ""  # with a server's reasoning parser, a chat's reasoning (chunks' reasoning_text)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.Logprobs] = field(default_factory=list)
    prompt_logprobs: list[pb.Logprobs] = field(default_factory=list)
    finish_reason: pb.FinishReason.ValueType = pb.FINISH_REASON_UNSPECIFIED
    # What stopped it when finish_reason is FINISH_REASON_STOP: a stop token id or a stop string (else None).
    stop_token_id: int | None = None
    stop_string: str | None = None
    usage: pb.Usage | None = None
    timings: pb.Timings | None = None
    tool_calls: list[pb.ToolCall] = field(default_factory=list)  # parsed from the output (chat with tools)
    content: str = ""  # with tool_calls: the text outside them

    def add(self, chunk: pb.GenerateResponse) -> None:
        """Appends one chunk of this sample; its last chunk (a finish_reason) adds what ended it."""
        self.request_id = chunk.request_id
        self.index = chunk.index
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self.text += chunk.text
        self.reasoning += chunk.reasoning_text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = chunk.finish_reason
            # Unset on a request that ended before it reached the engine (the proto's usage): None here.
            self.usage = chunk.usage if chunk.HasField("usage") else None
            self.timings = chunk.timings if chunk.HasField("timings") else None
            self.tool_calls.extend(chunk.tool_calls)
            self.content = chunk.content
            stop_reason = chunk.WhichOneof("stop_reason")
            if stop_reason is not None:
                setattr(self, stop_reason, getattr(chunk, stop_reason))

    def as_message(self) -> dict[str, Any]:
        """The assistant message that continues the conversation: the text, or the tool calls and the
        content beside them (then add a {"role": "tool", "tool_call_id": call.id, "content": ...}
        message per call); the reasoning, if any, as "reasoning_content"."""
        return assistant_message(self.text, self.content, self.tool_calls, self.reasoning)

    @property
    def finish_reason_name(self) -> str:
        """ "stop", "length", "abort", "error", or "" while unfinished."""
        if self.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            return ""
        return pb.FinishReason.Name(self.finish_reason).removeprefix("FINISH_REASON_").lower()


def collect_samples(chunks: Iterable[pb.GenerateResponse]) -> list[Completion]:
    """The chunks of one request, collected per sample, in `index` order."""
    samples: dict[int, Completion] = {}
    for chunk in chunks:
        samples.setdefault(chunk.index, Completion()).add(chunk)
    return [samples[index] for index in sorted(samples)]
