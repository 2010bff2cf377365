"""Request messages built from Python arguments: `generate_request` (a GenerateRequest) and
`tokenize_request` (a TokenizeRequest)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

from sluice.chat_messages import Tools, chat_messages, check_chat_fields, checked_flag
from sluice.v1 import sluice_pb2 as pb


def generate_request(
    text: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    tools: Tools | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | None = None,
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
    stream_interval: int = 0,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | Sequence[str] | None = (),
    stop_token_ids: Sequence[int] | None = (),
    ignore_eos: bool | None = None,
    logprobs: int | None = None,
    skip_special_tokens: bool | None = None,
    n: int | None = None,
    prompt_logprobs: int | None = None,
    truncate_prompt_tokens: int | None = None,
    include_stop_str_in_output: bool | None = None,
    logit_bias: Mapping[int, float] | None = None,
    allowed_token_ids: Sequence[int] | None = None,
    json_schema: str | Mapping[str, Any] | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
    json_object: bool = False,
    structural_tag: str | Mapping[str, Any] | None = None,
    timeout_seconds: float = 0.0,
    trace_context: Mapping[str, str] | None = None,
    disable_speculation: bool = False,
) -> pb.GenerateRequest:
    """Builds a GenerateRequest from one prompt form (`text`, `token_ids` or `messages`); sampling arguments
    left None take server defaults. `stop`: one stop string or several (None: none). `messages`, `tools`,
    `tool_choice` and the chat template options (`chat_template_kwargs`, `add_generation_prompt`,
    `continue_final_message`): see `sluice.chat_messages.chat_messages`.
    At most one constraint: `json_schema` (a dict or its JSON text), `regex`, `grammar`, `choice` (the
    strings the output may be), `json_object=True`, `structural_tag` (a dict or its JSON text).
    `n` > 1: that many samples of the prompt (collect them with `complete_samples`);
    `stream_interval` > 0: tokens per streamed chunk (0: the server's --stream-interval);
    `timeout_seconds` > 0: the server ends the request with DEADLINE_EXCEEDED after that long;
    `trace_context`: W3C traceparent/tracestate the request's server span continues."""
    _check_one_prompt_form(text=text, token_ids=token_ids, messages=messages)
    chat_options = {
        "chat_template_kwargs": chat_template_kwargs,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    check_chat_fields(messages, tools=tools, tool_choice=tool_choice, **chat_options)
    request = pb.GenerateRequest()
    scalars = {
        "request_id": request_id,
        "priority": priority,
        "cache_salt": cache_salt,
        "stream_interval": stream_interval,
        "timeout_seconds": timeout_seconds,
        "disable_speculation": disable_speculation,
    }
    for name, value in scalars.items():
        with _naming(name, value):
            setattr(request, name, value)
    with _naming("trace_context", trace_context):
        request.trace_context.update(trace_context or {})
    if text is not None:
        with _naming("text", text):
            if not isinstance(text, str):
                raise TypeError("text is a str")
            request.text = text
    if token_ids is not None:
        with _naming("token_ids", token_ids):
            request.token_ids.token_ids.extend(token_ids)
    if messages is not None:
        with _naming_without_value("messages"):  # text no UTF-8 holds (a lone surrogate)
            request.messages.CopyFrom(chat_messages(messages, tools, tool_choice, **chat_options))
    optional = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "seed": seed,
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "ignore_eos": ignore_eos,
        "logprobs": logprobs,
        "skip_special_tokens": skip_special_tokens,
        "n": n,
        "prompt_logprobs": prompt_logprobs,
        "truncate_prompt_tokens": truncate_prompt_tokens,
        "include_stop_str_in_output": include_stop_str_in_output,
    }
    sampling = request.sampling_params
    # protobuf's own errors name no field ("bad argument type ..."): `_naming` names it.
    for name, value in optional.items():
        if value is not None:
            with _naming(name, value):
                setattr(sampling, name, value)
    if isinstance(allowed_token_ids, Sized) and not len(allowed_token_ids):  # the proto's "unset"
        raise ValueError("allowed_token_ids: must not be empty (leave it unset to allow every token)")
    repeated = {
        "stop": (stop,) if isinstance(stop, str) else stop or (),
        "stop_token_ids": stop_token_ids or (),
        "allowed_token_ids": allowed_token_ids or (),
    }
    for name, values in repeated.items():
        with _naming(name, values):
            if isinstance(values, bytes):
                raise TypeError("bytes are not a list")
            getattr(sampling, name).extend(values)
    with _naming("logit_bias", logit_bias):
        sampling.logit_bias.update(logit_bias or {})
    constraints = {
        "json_schema": json_schema,
        "regex": regex,
        "grammar": grammar,
        "choice": choice,
        "json_object": checked_flag("json_object", json_object) or None,
        "structural_tag": structural_tag,
    }
    _set_constraint(sampling, {name: value for name, value in constraints.items() if value is not None})
    return request


@contextlib.contextmanager
def _naming(name: str, value: object) -> Iterator[None]:
    """protobuf's TypeError / ValueError for `value` (a float for an int, a value out of range, ...) as a
    ValueError naming the argument."""
    try:
        yield
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: {value!r} cannot be sent ({e})") from None


@contextlib.contextmanager
def _naming_without_value(name: str) -> Iterator[None]:
    """As `_naming`, for a value too large to quote (a conversation)."""
    try:
        yield
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: cannot be sent ({e})") from None


def _set_constraint(sampling: pb.SamplingParams, given: Mapping[str, Any]) -> None:
    """The one constraint given (ValueError naming them when several are)."""
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give one constraint, not {len(given)}")
    for name, value in given.items():
        if name == "choice" and isinstance(value, str | bytes):
            raise ValueError("choice: must be a list of strings, not one string")
        with _naming(name, value):
            if name == "choice":
                sampling.choice.choices.extend(value)
            elif name == "json_object":
                sampling.json_object.SetInParent()
            elif isinstance(value, Mapping):  # json_schema, structural_tag
                setattr(sampling, name, json.dumps(value))
            else:
                setattr(sampling, name, value)


def tokenize_request(
    text: str | None,
    messages: Sequence[Mapping[str, Any]] | None,
    add_special_tokens: bool | None,
    tools: Tools | None = None,
    **chat_options: Any,
) -> pb.TokenizeRequest:
    """Builds a TokenizeRequest for `text` or chat `messages` (with the `tools` their prompt lists, rendered
    as `chat_options` say: `chat_messages`' chat_template_kwargs, add_generation_prompt and
    continue_final_message)."""
    _check_one_prompt_form(text=text, messages=messages)
    check_chat_fields(messages, tools=tools, **chat_options)
    request = pb.TokenizeRequest()
    if text is not None:
        with _naming("text", text):
            request.text = text
    if messages is not None:
        with _naming_without_value("messages"):
            request.messages.CopyFrom(chat_messages(messages, tools, **chat_options))
    if add_special_tokens is not None:
        request.add_special_tokens = checked_flag("add_special_tokens", add_special_tokens)
    return request


def abort_request(request_id: str) -> pb.AbortRequest:
    """An AbortRequest for `request_id` (a ValueError naming it for a value protobuf cannot take)."""
    with _naming("request_id", request_id):
        return pb.AbortRequest(request_id=request_id)


def _check_one_prompt_form(**forms: object) -> None:
    """Raises ValueError naming the prompt forms when more than one is given (not None)."""
    given = [name for name, form in forms.items() if form is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give one prompt form, not {len(given)}")
