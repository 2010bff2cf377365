"""Typed Python clients for sluice.v1.InferenceService: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("localhost:50051") as client:
        for chunk in client.generate(generate_request("Hello", max_tokens=32, temperature=0)):
            print(chunk.text, end="", flush=True)

Every RPC failure is raised as `SluiceError(code, message)`.
"""

from __future__ import annotations

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


class SluiceError(Exception):
    """An RPC ended with a non-OK status; `code` is the grpc.StatusCode, `message` its details."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> SluiceError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code, details or "")


def _chat_messages(messages: Sequence[Mapping[str, str]]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])


def generate_request(
    text: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
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
    stop: Sequence[str] = (),
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
    """Builds a GenerateRequest from one prompt form; sampling arguments left None take server defaults.
    `n` > 1: that many samples of the prompt (collect them with `complete_samples`);
    `timeout_seconds` > 0: the server ends the request with DEADLINE_EXCEEDED after that long;
    `trace_context`: W3C traceparent/tracestate the request's server span continues."""
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
        request.messages.CopyFrom(_chat_messages(messages))
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
    sampling.stop.extend(stop)
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
    usage: pb.Usage | None = None
    timings: pb.Timings | None = None

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
    `session_affinity` swaps the default service config for the ring-hash one. Messages of any size are
    received unless `options` set MAX_RECEIVE_OPTION."""
    if session_affinity:
        enable_request_hash_header()
        if service_config is SERVICE_CONFIG:
            service_config = SESSION_AFFINITY_SERVICE_CONFIG
    options = list(options)
    if not any(name == MAX_RECEIVE_OPTION for name, _ in options):
        options.append((MAX_RECEIVE_OPTION, -1))
    options = channel_options(None if service_config is None else dict(service_config), options)
    if credentials is None:
        return api.insecure_channel(target, options=options)
    return api.secure_channel(target, credentials, options=options)


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
    ) -> Iterator[pb.GenerateResponse]:
        """Streams chunks; leaving the loop early cancels the call (the server then aborts the request)."""
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
    ) -> Iterator[pb.StreamGenerateResponse]:
        """Many requests on one bidirectional stream; responses are tagged with their request_id."""
        return self._streamed(self._stub.StreamGenerate, iter(requests), timeout, metadata, session)

    def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        request = _tokenize_request(text, messages, add_special_tokens)
        return list(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def model_info(self, *, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def _unary(self, method: grpc.UnaryUnaryMultiCallable, request: object, timeout: float | None) -> object:
        try:
            return method(request, timeout=timeout, metadata=_auth_metadata(self._api_key, ()))
        except grpc.RpcError as error:
            raise SluiceError.from_rpc_error(error) from None

    def _streamed(
        self, method: grpc.UnaryStreamMultiCallable | grpc.StreamStreamMultiCallable, request: object,
        timeout: float | None, metadata: Metadata, session: str | None,
    ) -> Iterator[object]:  # fmt: skip
        """The call's responses; its errors as SluiceError; cancelled when the caller stops early."""
        call = method(request, timeout=timeout, metadata=_auth_metadata(self._api_key, metadata, session))
        try:
            yield from call
        except grpc.RpcError as error:
            raise SluiceError.from_rpc_error(error) from None
        finally:
            call.cancel()


def _tokenize_request(
    text: str | None, messages: Sequence[Mapping[str, str]] | None, add_special_tokens: bool | None
) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest()
    if text is not None:
        request.text = text
    if messages is not None:
        request.messages.CopyFrom(_chat_messages(messages))
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
    ) -> AsyncIterator[pb.GenerateResponse]:
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
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        return self._streamed(self._stub.StreamGenerate, requests, timeout, metadata, session)

    async def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        request = _tokenize_request(text, messages, add_special_tokens)
        return list((await self._unary(self._stub.Tokenize, request, timeout)).token_ids)

    async def model_info(self, *, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    async def _unary(
        self, method: grpc.aio.UnaryUnaryMultiCallable, request: object, timeout: float | None
    ) -> object:
        try:
            return await method(request, timeout=timeout, metadata=_auth_metadata(self._api_key, ()))
        except grpc.RpcError as error:
            raise SluiceError.from_rpc_error(error) from None

    async def _streamed(
        self, method: grpc.aio.UnaryStreamMultiCallable | grpc.aio.StreamStreamMultiCallable, request: object,
        timeout: float | None, metadata: Metadata, session: str | None,
    ) -> AsyncIterator[object]:  # fmt: skip
        """The call's responses; its errors as SluiceError; cancelled when the caller stops early."""
        call = method(request, timeout=timeout, metadata=_auth_metadata(self._api_key, metadata, session))
        try:
            async for response in call:
                yield response
        except grpc.RpcError as error:
            raise SluiceError.from_rpc_error(error) from None
        finally:
            call.cancel()
