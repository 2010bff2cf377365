"""Pure conversions between sluice.v1 messages and engine types. No I/O, no grpc calls; a prompt's logprobs
go into a response in slices, the event loop served in between (`generate_response`)."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format, struct_pb2

from sluice.engine.errors import InvalidRequestError
from sluice.engine.model_info import ModelInfo
from sluice.engine.outputs import LogprobColumns, RequestOutput, Timings, Usage
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.tool_calls import Tool, ToolUse
from sluice.engine.text.chat_template import ChatTemplateOptions
from sluice.service.generation_spec import GenerationSpec, Prompt
from sluice.v1 import sluice_pb2 as pb

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

# Scalar SamplingParams fields that are proto3 `optional`: copied only when the caller set them.
_OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "logprobs",
    "skip_special_tokens",
    "n",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "include_stop_str_in_output",
)

# A prompt's logprobs go into a response this many positions at a time, and the event loop, which serves
# every stream, runs in between: a 5,800-token prompt at 20 top is ~120,000 messages, ~0.12 s to build.
PROMPT_LOGPROBS_PER_SLICE = 256
# Room for any digest or id a caller salts with (vLLM suggests a random 256-bit value, 44 in base64).
MAX_CACHE_SALT_BYTES = 256

_TOOL_CHOICE_MODES = {
    pb.TOOL_CHOICE_MODE_NONE: "none",
    pb.TOOL_CHOICE_MODE_AUTO: "auto",
    pb.TOOL_CHOICE_MODE_REQUIRED: "required",
}

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


def sampling_params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """Absent optional fields keep SamplingParams' defaults; raises ValueError naming a bad field."""
    kwargs: dict[str, object] = {
        name: getattr(message, name) for name in _OPTIONAL_SAMPLING_FIELDS if message.HasField(name)
    }
    kwargs["stop"] = tuple(message.stop)
    kwargs["stop_token_ids"] = tuple(message.stop_token_ids)
    kwargs["logit_bias"] = dict(message.logit_bias)
    kwargs["allowed_token_ids"] = tuple(message.allowed_token_ids) or None
    kwargs["constraint"] = constraint_from_proto(message)
    return SamplingParams(**kwargs)


def generation_spec_from_proto(request: pb.GenerateRequest) -> GenerationSpec:
    """Raises ValueError naming a bad field."""
    return GenerationSpec(
        prompt=prompt_from_proto(request),
        params=sampling_params_from_proto(request.sampling_params),
        tool_use=tool_use_from_proto(request),
        timeout=timeout_from_proto(request),
        priority=request.priority,
        cache_salt=cache_salt_from_proto(request),
        stream_interval=request.stream_interval or None,
        use_speculation=not request.disable_speculation,
        trace_context=dict(request.trace_context),
    )


def cache_salt_from_proto(request: pb.GenerateRequest) -> str:
    """Raises InvalidRequestError past MAX_CACHE_SALT_BYTES: the salt travels with every cached block's
    KV event and stays in the frontend's view of the cache as long as the block."""
    size = len(request.cache_salt.encode())
    if size > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(
            "cache_salt", f"must be at most {MAX_CACHE_SALT_BYTES} bytes (UTF-8), got {size}"
        )
    return request.cache_salt


def timeout_from_proto(request: pb.GenerateRequest) -> float | None:
    """The request's own timeout in seconds; None when 0 (none). Raises InvalidRequestError if it is
    negative or not finite."""
    seconds = request.timeout_seconds
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidRequestError("timeout_seconds", f"must be a finite number >= 0, got {seconds}")
    return seconds or None


def constraint_from_proto(message: pb.SamplingParams) -> Constraint | None:
    """Maps the `constraint` oneof; unset is None."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return Constraint(choice=tuple(message.choice.choices))
    if kind == "json_object":
        return Constraint(json_object=True)
    return Constraint(**{kind: getattr(message, kind)})


def tool_use_from_proto(request: pb.GenerateRequest) -> ToolUse | None:
    """The tools of a chat request and its tool_choice (unset: "auto"); None without tools."""
    if request.WhichOneof("prompt") != "messages":
        return None
    return tool_use_from_chat(request.messages)


def tool_use_from_chat(chat: pb.ChatMessages) -> ToolUse | None:
    """`tool_use_from_proto` of a conversation (Generate's or Tokenize's)."""
    if not chat.tools:
        if chat.HasField("tool_choice"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    tools = tuple(Tool(t.name, t.description, t.parameters) for t in chat.tools)
    kind = chat.tool_choice.WhichOneof("choice")
    if kind == "function_name":
        return ToolUse(tools, chat.tool_choice.function_name, named=True)
    mode = chat.tool_choice.mode
    if mode not in _TOOL_CHOICE_MODES and mode != pb.TOOL_CHOICE_MODE_UNSPECIFIED:
        raise InvalidRequestError("tool_choice.mode", f"unknown value {mode}")
    return ToolUse(tools, _TOOL_CHOICE_MODES.get(mode, "auto"))


def messages_from_proto(chat: pb.ChatMessages) -> tuple[dict[str, Any], ...]:
    """The conversation in the form `template_messages` takes; unset optional fields left out."""
    return tuple(_message_from_proto(message) for message in chat.messages)


def chat_options_from_proto(chat: pb.ChatMessages) -> ChatTemplateOptions:
    """How the chat template renders the conversation: an unset add_generation_prompt is true, and the
    kwargs' whole numbers are ints (a Struct holds every number as a double; vLLM's JSON gives ints)."""
    return ChatTemplateOptions(
        chat_template_kwargs={
            key: _whole_numbers_as_ints(_template_kwarg(key, value))
            for key, value in sorted(chat.chat_template_kwargs.fields.items())
        },
        add_generation_prompt=(
            chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        ),
        continue_final_message=chat.continue_final_message,
    )


def _template_kwarg(key: str, value: struct_pb2.Value) -> Any:
    """One kwarg as a JSON value; a NaN or an infinity (a Struct holds them, JSON has no such number)
    is refused naming its key."""
    try:
        return json_format.MessageToDict(value)
    except ValueError:
        raise InvalidRequestError(
            f"chat_template_kwargs.{key}", "holds NaN or an infinity, which JSON has no number for"
        ) from None


def _whole_numbers_as_ints(value: Any) -> Any:
    """A Struct value as JSON parsing gives it: 2.0 as 2 (a template prints 2.0 as "2.0")."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _whole_numbers_as_ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole_numbers_as_ints(item) for item in value]
    return value


def _message_from_proto(message: pb.ChatMessage) -> dict[str, Any]:
    converted: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        converted["tool_calls"] = [
            {"id": call.id, "name": call.name, "arguments": call.arguments} for call in message.tool_calls
        ]
    if message.tool_call_id:
        converted["tool_call_id"] = message.tool_call_id
    if message.name:
        converted["name"] = message.name
    if message.reasoning_content:
        converted["reasoning_content"] = message.reasoning_content
    return converted


def prompt_from_proto(request: pb.GenerateRequest) -> Prompt:
    """Maps the `prompt` oneof; an unset oneof is an empty prompt, which the engine rejects."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return Prompt(token_ids=tuple(request.token_ids.token_ids))
    if kind == "messages":
        return Prompt(
            messages=messages_from_proto(request.messages),
            chat_options=chat_options_from_proto(request.messages),
        )
    return Prompt(text=request.text)


def usage_to_proto(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        prompt_tokens_computed=usage.prompt_tokens_computed,
        draft_tokens=usage.draft_tokens,
        accepted_draft_tokens=usage.accepted_draft_tokens,
    )


def timings_to_proto(timings: Timings) -> pb.Timings:
    """Seconds since arrival; an event that never happened (e.g. aborted while queued) reads 0."""
    return pb.Timings(
        queue_seconds=timings.queue_seconds or 0.0,
        ttft_seconds=timings.ttft_seconds or 0.0,
        total_seconds=timings.total_seconds or 0.0,
    )


async def generate_response(output: RequestOutput, request_id: str) -> pb.GenerateResponse:
    """`generate_response_from_output` with the output's prompt logprobs, added in slices."""
    response = generate_response_from_output(output, request_id)
    values = output.prompt_logprobs
    if values:  # once per request at most: every other chunk of the stream skips the slicing
        await in_slices(len(values), functools.partial(add_logprobs, response.prompt_logprobs, values))
    return response


async def in_slices(num_positions: int, add: Callable[[int, int], None]) -> None:
    """add(start, end) over [0, num_positions), PROMPT_LOGPROBS_PER_SLICE positions at a time, yielding to
    the event loop between slices."""
    for start in range(0, num_positions, PROMPT_LOGPROBS_PER_SLICE):
        if start:
            await asyncio.sleep(0)
        add(start, min(start + PROMPT_LOGPROBS_PER_SLICE, num_positions))


def add_logprobs(
    entries: RepeatedCompositeFieldContainer[pb.Logprobs], values: LogprobColumns, start: int, end: int
) -> None:
    """Appends entries [start, end) of `values` to a repeated `Logprobs` field, each built in place from
    the columns (half the time of building the messages and copying them in)."""
    num_top = values.num_top
    add = entries.add
    for position in range(start, end):
        entry = add()
        entry.sampled.token_id = values.token_ids[position]
        entry.sampled.logprob = values.logprobs[position]
        add_top = entry.top.add
        for j in range(position * num_top, (position + 1) * num_top):
            add_top(token_id=values.top_token_ids[j], logprob=values.top_logprobs[j])


def generate_response_from_output(output: RequestOutput, request_id: str) -> pb.GenerateResponse:
    """One engine delta as one chunk, named by the caller's request id (not the engine's) and, for
    n > 1, the sample's index; without its prompt logprobs (`generate_response` adds them)."""
    response = pb.GenerateResponse(
        request_id=request_id,
        text=output.text,
        token_ids=output.token_ids,
        index=output.index,
        reasoning_text=output.reasoning,
    )
    if output.logprobs:
        add_logprobs(response.logprobs, output.logprobs, 0, len(output.logprobs))
    if output.finish_reason is not None:
        response.finish_reason = FINISH_REASONS[output.finish_reason]
    if isinstance(output.stop_reason, str):
        response.stop_string = output.stop_reason
    elif isinstance(output.stop_reason, int):
        response.stop_token_id = output.stop_reason
    if not output.finished:  # usage and timings go out once, on the last chunk
        return response
    if output.usage is not None:
        response.usage.CopyFrom(usage_to_proto(output.usage))
    if output.timings is not None:
        response.timings.CopyFrom(timings_to_proto(output.timings))
    response.tool_calls.extend(
        pb.ToolCall(name=call.name, arguments=call.arguments, id=call.id) for call in output.tool_calls
    )
    response.content = output.content
    return response


def model_info_to_proto(info: ModelInfo) -> pb.GetModelInfoResponse:
    return pb.GetModelInfoResponse(
        model_name=info.name,
        architecture=info.architecture,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        kv_capacity_tokens=info.kv_capacity_tokens,
        speculative_method=info.speculative_method,
        num_speculative_tokens=info.num_speculative_tokens,
        max_num_batched_tokens=info.max_num_batched_tokens,
        max_num_seqs=info.max_num_seqs,
    )
