"""Typed Python clients for sluice.v1.InferenceService: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("localhost:50051") as client:
        for chunk in client.generate(generate_request("Hello", max_tokens=32, temperature=0)):
            print(chunk.text, end="", flush=True)

A call that fails is raised as `SluiceError(code, message)`. A streaming call starts when it is made and
ends early when its stream is closed (`close()`, leaving a `with` block, or dropping the stream).
An `AsyncClient` belongs to the event loop it was created in (grpc.aio's rule): create it inside that loop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import grpc

from sluice.service_config import (
    SERVICE_CONFIG,
    SESSION_AFFINITY_SERVICE_CONFIG,
    SESSION_HEADER,
    channel_options,
    enable_request_hash_header,
)
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

Metadata = Sequence[tuple[str, str]]

# gRPC's default of 4 MB would refuse the first chunk of a long prompt asked for `prompt_logprobs` (about
# 200 bytes a prompt token at 20 top): this client takes messages of any size unless told otherwise.
MAX_RECEIVE_OPTION = "grpc.max_receive_message_length"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class SluiceError(Exception):
    """An RPC ended with a non-OK status; `code` is the grpc.StatusCode, `message` its details and
    `trailing_metadata` the server's trailers (e.g. `grpc-retry-pushback-ms` on RESOURCE_EXHAUSTED)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, trailing_metadata: Mapping[str, str | bytes] | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.trailing_metadata = dict(trailing_metadata or {})

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> SluiceError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        return cls(code, details or "", dict(trailers or ()))

    @property
    def retry_pushback_ms(self) -> int | None:
        """How long the server asked the caller to wait before retrying, if it did."""
        value = self.trailing_metadata.get(RETRY_PUSHBACK_KEY)
        return int(value) if value is not None else None


Tools = Sequence[pb.Tool | Mapping[str, Any]]
TOOL_CHOICE_MODES = {
    "none": pb.TOOL_CHOICE_MODE_NONE,
    "auto": pb.TOOL_CHOICE_MODE_AUTO,
    "required": pb.TOOL_CHOICE_MODE_REQUIRED,
}


def _chat_messages(
    messages: Sequence[Mapping[str, Any]], tools: Tools | None = None, tool_choice: str | None = None
) -> pb.ChatMessages:
    """Messages as dicts: "role", "content" (None for none), and for a tool-using turn "tool_calls" (an
    assistant's: `Completion.as_message()`'s {"id", "name", "arguments"}, OpenAI's {"id", "type",
    "function": {"name", "arguments"}} or `pb.ToolCall`s), "tool_call_id" and "name" (a tool's result).
    `tools`: `pb.Tool`s or dicts, {"name", "description", "parameters"} or OpenAI's {"type": "function",
    "function": {...}}, parameters a JSON schema or its text; `tool_choice`: "none", "auto", "required"
    or a tool's name (unset: auto)."""
    chat = pb.ChatMessages(
        messages=[_chat_message(message) for message in messages], tools=[_tool(t) for t in tools or ()]
    )
    if tool_choice in TOOL_CHOICE_MODES:
        chat.tool_choice.mode = TOOL_CHOICE_MODES[tool_choice]
    elif tool_choice is not None:
        chat.tool_choice.function_name = tool_choice
    return chat


def _tool(tool: pb.Tool | Mapping[str, Any]) -> pb.Tool:
    if isinstance(tool, pb.Tool):
        return tool
    function, parameters = _function_and_json_text(tool, "parameters")
    return pb.Tool(
        name=function["name"], description=function.get("description") or "", parameters=parameters
    )


def _function_and_json_text(entry: Mapping[str, Any], key: str) -> tuple[Mapping[str, Any], str]:
    """A tool's or a call's fields (OpenAI's form wraps them in "function") and its `key` as JSON text
    (given as a JSON value or as its text)."""
    function = entry.get("function", entry)
    value = function.get(key) or ""
    return function, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _chat_message(message: Mapping[str, Any]) -> pb.ChatMessage:
    return pb.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_calls=[_tool_call(call) for call in message.get("tool_calls") or ()],
        tool_call_id=message.get("tool_call_id") or "",
        name=message.get("name") or "",
    )


def _tool_call(call: pb.ToolCall | Mapping[str, Any]) -> pb.ToolCall:
    if isinstance(call, pb.ToolCall):
        return call
    function, arguments = _function_and_json_text(call, "arguments")
    return pb.ToolCall(id=call.get("id") or "", name=function["name"], arguments=arguments)


def generate_request(
    text: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    tools: Tools | None = None,
    tool_choice: str | None = None,
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
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
    stop: str | Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool | None = None,
    logprobs: int | None = None,
    skip_special_tokens: bool | None = None,
    n: int | None = None,
    prompt_logprobs: int | None = None,
    timeout_seconds: float = 0.0,
    trace_context: Mapping[str, str] | None = None,
    disable_speculation: bool = False,
) -> pb.GenerateRequest:
    """Builds a GenerateRequest from one prompt form (`text`, `token_ids` or `messages`); sampling arguments
    left None take server defaults. `stop`: one stop string or several. `messages`, `tools` and
    `tool_choice`: see `_chat_messages`.
    `n` > 1: that many samples of the prompt (collect them with `complete_samples`);
    `timeout_seconds` > 0: the server ends the request with DEADLINE_EXCEEDED after that long;
    `trace_context`: W3C traceparent/tracestate the request's server span continues."""
    forms = [
        name
        for name, form in (("text", text), ("token_ids", token_ids), ("messages", messages))
        if form is not None
    ]
    if len(forms) > 1:
        raise ValueError(f"{' and '.join(forms)}: give one prompt form, not {len(forms)}")
    _check_tools(messages, tools, tool_choice)
    request = pb.GenerateRequest(
        request_id=request_id,
        priority=priority,
        cache_salt=cache_salt,
        timeout_seconds=timeout_seconds,
        trace_context=dict(trace_context or {}),
        disable_speculation=disable_speculation,
    )
    if text is not None:
        request.text = text
    if token_ids is not None:
        request.token_ids.token_ids.extend(token_ids)
    if messages is not None:
        request.messages.CopyFrom(_chat_messages(messages, tools, tool_choice))
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
    }
    sampling = request.sampling_params
    for name, value in optional.items():
        if value is not None:
            setattr(sampling, name, value)
    sampling.stop.extend((stop,) if isinstance(stop, str) else stop)
    sampling.stop_token_ids.extend(stop_token_ids)
    return request


@dataclass
class Completion:
    """A whole generation (one sample of it), collected from its chunks."""

    request_id: str = ""
    index: int = 0  # which of the request's n samples
    text: str = ""
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
        self.request_id = chunk.request_id
        self.index = chunk.index
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = chunk.finish_reason
            self.usage = chunk.usage
            self.timings = chunk.timings
            self.tool_calls.extend(chunk.tool_calls)
            self.content = chunk.content
            stop_reason = chunk.WhichOneof("stop_reason")
            if stop_reason is not None:
                setattr(self, stop_reason, getattr(chunk, stop_reason))

    def as_message(self) -> dict[str, Any]:
        """The assistant message that continues the conversation: the text, or the tool calls and the
        content beside them (then add a {"role": "tool", "tool_call_id": call.id, "content": ...}
        message per call)."""
        if not self.tool_calls:
            return {"role": "assistant", "content": self.text}
        tool_calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in self.tool_calls]
        return {"role": "assistant", "content": self.content, "tool_calls": tool_calls}

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


def _single(request: pb.GenerateRequest) -> None:
    if request.sampling_params.n > 1:
        raise ValueError("sampling_params.n > 1: collect the samples with complete_samples()")


def _auth_metadata(
    api_key: str | None, metadata: Metadata, session: str | None = None
) -> tuple[tuple[str, str], ...]:
    if session and not (session.isascii() and session.isprintable()):
        raise ValueError(f"session: {session!r} is not printable ASCII (it is sent as a gRPC header value)")
    auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    affinity = ((SESSION_HEADER, session),) if session else ()
    return (*auth, *affinity, *metadata)


def _open_channel(
    api: ModuleType,
    target: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, object]],
    service_config: Mapping[str, Any] | None,
    session_affinity: bool = False,
) -> grpc.Channel | grpc.aio.Channel:
    """A channel from `api` (the `grpc` or `grpc.aio` module): TLS when `credentials` are given.
    `session_affinity` swaps the default service config for the ring-hash one; any config keyed on a
    request header (given here or in `options`) gets the header honoured. Messages of any size are
    received unless `options` set MAX_RECEIVE_OPTION."""
    if session_affinity and service_config is SERVICE_CONFIG:
        service_config = SESSION_AFFINITY_SERVICE_CONFIG
    configs = [value for name, value in options if name == "grpc.service_config"]
    if service_config is not None:
        configs.append(json.dumps(service_config))
    if session_affinity or any("requestHashHeader" in str(config) for config in configs):
        enable_request_hash_header()
    options = list(options)
    if not any(name == MAX_RECEIVE_OPTION for name, _ in options):
        options.append((MAX_RECEIVE_OPTION, -1))
    options = channel_options(None if service_config is None else dict(service_config), options)
    if credentials is None:
        return api.insecure_channel(target, options=options)
    return api.secure_channel(target, credentials, options=options)


class ResponseStream(Iterator[Any]):
    """The responses of a streaming call, which started when it was made. `close()` (or leaving a `with`
    block) cancels the call, and the server aborts its requests; so does dropping the stream (grpc cancels
    a call it garbage-collects). A failed call raises SluiceError."""

    def __init__(self, call: grpc.Call) -> None:
        self._call = call
        self._closed = False

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            return next(self._call)
        except grpc.RpcError as error:
            raise SluiceError.from_rpc_error(error) from None

    def close(self) -> None:
        self._closed = True
        self._call.cancel()

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncResponseStream(AsyncIterator[Any]):
    """`ResponseStream` for asyncio: `await stream.aclose()` or `async with` cancels the call."""

    def __init__(self, call: grpc.aio.Call) -> None:
        self._call = call
        self._closed = False

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        try:
            response = await self._call.read()
        except grpc.RpcError as error:
            raise SluiceError.from_rpc_error(error) from None
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return response

    async def aclose(self) -> None:
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Client:
    """Blocking client. `credentials` set means TLS; `api_key` is sent as a bearer token on every call.

    `service_config` (default: sluice.service_config.SERVICE_CONFIG, round robin over healthy replicas,
    UNAVAILABLE retried) is the channel's gRPC service config; None leaves grpc's defaults. Give a
    `dns:///name:port` target so every replica behind the name is used.

    `session_affinity=True` uses SESSION_AFFINITY_SERVICE_CONFIG instead (ring hash on the
    `x-sluice-session` header): calls given the same `session=` go to the same replica, so a
    conversation's later turns hit its prefix cache.
    """

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        api_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, object]] = (),
        service_config: Mapping[str, Any] | None = SERVICE_CONFIG,
        session_affinity: bool = False,
    ) -> None:
        self._channel = _open_channel(grpc, target, credentials, options, service_config, session_affinity)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._api_key = api_key

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        request: pb.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> ResponseStream:
        """Starts the call and streams its chunks. Closing the stream early (`close()`, or a `with` block
        around it) cancels the call and the server aborts the request; so does dropping it."""
        return self._streamed(self._stub.Generate, request, timeout, metadata, session)

    def complete(
        self,
        request: pb.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> Completion:
        """Runs one request (n = 1) to its end and returns the collected text, tokens, usage and timings."""
        _single(request)
        completion = Completion()
        for chunk in self.generate(request, timeout=timeout, metadata=metadata, session=session):
            completion.add(chunk)
        return completion

    def complete_samples(
        self,
        request: pb.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> list[Completion]:
        """Runs a request with `sampling_params.n` samples to its end: one Completion per sample."""
        return collect_samples(self.generate(request, timeout=timeout, metadata=metadata, session=session))

    def stream_generate(
        self,
        requests: Iterable[pb.StreamGenerateRequest],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> ResponseStream:
        """Many requests on one bidirectional stream; responses are tagged with their request_id."""
        return self._streamed(self._stub.StreamGenerate, iter(requests), timeout, metadata, session)

    def abort(
        self,
        request_id: str,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> None:
        """Aborts a running request by id. With session affinity give the request's `session`, so the
        abort reaches the replica that runs it."""
        self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout, metadata, session)

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Tools | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> list[int]:
        request = _tokenize_request(text, messages, add_special_tokens, tools)
        return list(self._unary(self._stub.Tokenize, request, timeout, metadata).token_ids)

    def model_info(self, *, timeout: float | None = None, metadata: Metadata = ()) -> pb.GetModelInfoResponse:
        return self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, metadata)

    def _unary(
        self, method: grpc.UnaryUnaryMultiCallable, request: object, timeout: float | None,
        metadata: Metadata = (), session: str | None = None,
    ) -> object:  # fmt: skip
        try:
            return method(request, timeout=timeout, metadata=_auth_metadata(self._api_key, metadata, session))
        except grpc.RpcError as error:
            raise SluiceError.from_rpc_error(error) from None

    def _streamed(
        self, method: grpc.UnaryStreamMultiCallable | grpc.StreamStreamMultiCallable, request: object,
        timeout: float | None, metadata: Metadata, session: str | None,
    ) -> ResponseStream:  # fmt: skip
        return ResponseStream(
            method(request, timeout=timeout, metadata=_auth_metadata(self._api_key, metadata, session))
        )


def _check_tools(
    messages: Sequence[Mapping[str, Any]] | None, tools: Tools | None, tool_choice: str | None
) -> None:
    if messages is None and (tools is not None or tool_choice is not None):
        raise ValueError(f"{'tools' if tools is not None else 'tool_choice'}: needs messages")


def _tokenize_request(
    text: str | None,
    messages: Sequence[Mapping[str, Any]] | None,
    add_special_tokens: bool | None,
    tools: Tools | None = None,
) -> pb.TokenizeRequest:
    _check_tools(messages, tools, None)
    request = pb.TokenizeRequest()
    if text is not None:
        request.text = text
    if messages is not None:
        request.messages.CopyFrom(_chat_messages(messages, tools))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


class AsyncClient:
    """asyncio client with the same methods (and service config) as `Client`, awaited; streams are
    async iterators."""

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        api_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, object]] = (),
        service_config: Mapping[str, Any] | None = SERVICE_CONFIG,
        session_affinity: bool = False,
    ) -> None:
        self._channel = _open_channel(
            grpc.aio, target, credentials, options, service_config, session_affinity
        )
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._api_key = api_key

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def generate(
        self,
        request: pb.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> AsyncResponseStream:
        """As `Client.generate`: started at once; `await stream.aclose()` (or `async with`) cancels it."""
        return self._streamed(self._stub.Generate, request, timeout, metadata, session)

    async def complete(
        self,
        request: pb.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> Completion:
        _single(request)
        completion = Completion()
        async for chunk in self.generate(request, timeout=timeout, metadata=metadata, session=session):
            completion.add(chunk)
        return completion

    async def complete_samples(
        self,
        request: pb.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> list[Completion]:
        return collect_samples(
            [c async for c in self.generate(request, timeout=timeout, metadata=metadata, session=session)]
        )

    def stream_generate(
        self,
        requests: AsyncIterable[pb.StreamGenerateRequest] | Iterable[pb.StreamGenerateRequest],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> AsyncResponseStream:
        return self._streamed(self._stub.StreamGenerate, requests, timeout, metadata, session)

    async def abort(
        self,
        request_id: str,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> None:
        await self._unary(
            self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout, metadata, session
        )

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Tools | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> list[int]:
        request = _tokenize_request(text, messages, add_special_tokens, tools)
        return list((await self._unary(self._stub.Tokenize, request, timeout, metadata)).token_ids)

    async def model_info(
        self, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> pb.GetModelInfoResponse:
        return await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, metadata)

    async def _unary(
        self, method: grpc.aio.UnaryUnaryMultiCallable, request: object, timeout: float | None,
        metadata: Metadata = (), session: str | None = None,
    ) -> object:  # fmt: skip
        try:
            return await method(
                request, timeout=timeout, metadata=_auth_metadata(self._api_key, metadata, session)
            )
        except grpc.RpcError as error:
            raise SluiceError.from_rpc_error(error) from None

    def _streamed(
        self, method: grpc.aio.UnaryStreamMultiCallable | grpc.aio.StreamStreamMultiCallable, request: object,
        timeout: float | None, metadata: Metadata, session: str | None,
    ) -> AsyncResponseStream:  # fmt: skip
        return AsyncResponseStream(
            method(request, timeout=timeout, metadata=_auth_metadata(self._api_key, metadata, session))
        )
