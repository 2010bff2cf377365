"""Typed Python clients for sluice.v1.InferenceService: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("localhost:50051") as client:
        for chunk in client.generate(generate_request("Hello", max_tokens=32, temperature=0)):
            print(chunk.text, end="", flush=True)

A call that fails is raised as `SluiceError(code, message)`. A streaming call starts when it is made and
ends early when its stream is closed (`close()`, leaving a `with` block, or dropping the stream).
An `AsyncClient` belongs to the event loop it was created in (grpc.aio's rule): create it inside that loop.

The parts the clients use live beside them and stay importable from here: `generate_request`
(sluice.request_builders), `Completion` (sluice.completion), `SluiceError` (sluice.sluice_error), the
streams (sluice.response_stream), the channel (sluice.channel) and the chat conversion
(sluice.chat_messages).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from typing import Any

import grpc

from sluice.channel import MAX_RECEIVE_OPTION, open_channel
from sluice.chat_messages import TOOL_CHOICE_MODES, Tools
from sluice.completion import Completion, collect_samples
from sluice.request_builders import abort_request, generate_request, tokenize_request
from sluice.request_feed import RequestFeed
from sluice.response_stream import AsyncResponseStream, ResponseStream
from sluice.service_config import SERVICE_CONFIG, SESSION_AFFINITY_SERVICE_CONFIG, SESSION_HEADER
from sluice.sluice_error import RETRY_PUSHBACK_KEY, SluiceError
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

__all__ = [
    "MAX_RECEIVE_OPTION",
    "RETRY_PUSHBACK_KEY",
    "SERVICE_CONFIG",
    "SESSION_AFFINITY_SERVICE_CONFIG",
    "TOOL_CHOICE_MODES",
    "AsyncClient",
    "AsyncResponseStream",
    "Client",
    "Completion",
    "Metadata",
    "ResponseStream",
    "SluiceError",
    "Tools",
    "collect_samples",
    "generate_request",
]

Metadata = Sequence[tuple[str, str]]


def _checked_request(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """grpc sent anything else as it could: the blocking client raised grpc's own INTERNAL "Exception
    serializing request!" (no SluiceError), AsyncClient sent a string as an empty request."""
    if not isinstance(request, pb.GenerateRequest):
        name = type(request).__name__
        raise TypeError(f"request: must be a sluice.v1.GenerateRequest (see generate_request()), got {name}")
    return request


def _single(request: pb.GenerateRequest) -> None:
    if _checked_request(request).sampling_params.n > 1:
        raise ValueError("sampling_params.n > 1: collect the samples with complete_samples()")


def _checked_api_key(api_key: str | None) -> str | None:
    """The key, sent as a gRPC header value: printable ASCII, no surrounding spaces (as the server takes
    keys). One read from a file with its newline failed each call with INTERNAL "Invalid metadata", and
    on AsyncClient with an error that was no SluiceError. The key itself is never in the message."""
    if api_key is None:
        return None
    if not isinstance(api_key, str) or not api_key or api_key != api_key.strip():
        raise ValueError("api_key: must be a non-empty string without surrounding whitespace")
    if not (api_key.isascii() and api_key.isprintable()):
        raise ValueError("api_key: must be printable ASCII (it is sent as a gRPC header value)")
    return api_key


def _check_metadata_entry(key: str, value: str | bytes) -> None:
    """What gRPC sends as a header (grpc/doc/PROTOCOL-HTTP2.md): the value never in the message, it may
    be a secret. grpc.aio failed these calls with its own ExecuteBatchError, no SluiceError."""
    if not re.fullmatch(r"[0-9a-z_.-]+", key):
        raise ValueError(f"metadata: key {key!r} may hold only lowercase letters, digits, '-', '_' and '.'")
    if key.endswith("-bin"):
        if not isinstance(value, bytes):
            raise ValueError(f"metadata: the value of {key!r} must be bytes (its key ends in -bin)")
        return
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    if not (text.isascii() and text.isprintable()):
        raise ValueError(
            f"metadata: the value of {key!r} must be printable ASCII (any bytes under a -bin key)"
        )


# grpc ends a call at once whose deadline it cannot hold (from ~1e10 s, and inf: DEADLINE_EXCEEDED before
# the call is sent): a longer timeout is no deadline.
MAX_TIMEOUT_S = 1e9


def _deadline(timeout: float | None) -> float | None:
    """`timeout` as grpc takes it: None (and inf, or anything past MAX_TIMEOUT_S) no deadline; a ValueError
    naming it when it is no number of seconds > 0."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"timeout: must be a number of seconds > 0 (None: no deadline), got {timeout!r}")
    return None if timeout > MAX_TIMEOUT_S else float(timeout)


def _call_options(
    api_key: str | None, timeout: float | None, metadata: Metadata, session: str | None
) -> dict[str, Any]:
    """A call's grpc keyword arguments: its deadline and metadata, checked."""
    return {"timeout": _deadline(timeout), "metadata": _auth_metadata(api_key, metadata, session)}


def _auth_metadata(
    api_key: str | None, metadata: Metadata, session: str | None = None
) -> tuple[tuple[str, str], ...]:
    if session is not None and not isinstance(session, str):
        raise ValueError(f"session: must be a str, got {session!r}")
    if session and not (session.isascii() and session.isprintable()):
        raise ValueError(f"session: {session!r} is not printable ASCII (it is sent as a gRPC header value)")
    # grpc's own errors named nothing: a dict failed to unpack, an upper-case key was INTERNAL.
    if isinstance(metadata, Mapping):
        raise ValueError("metadata: must be (key, value) pairs, not a dict: pass list(metadata.items())")
    for entry in metadata:
        key = entry[0] if isinstance(entry, tuple | list) and len(entry) == 2 else None
        if not isinstance(key, str) or key != key.lower() or not isinstance(entry[1], str | bytes):
            shown = key if isinstance(key, str) else type(entry).__name__
            raise ValueError(f"metadata: must be (key, value) pairs, keys lowercase strings; got {shown!r}")
        _check_metadata_entry(key, entry[1])
    auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    affinity = ((SESSION_HEADER, session),) if session else ()
    return (*auth, *affinity, *metadata)


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
        self._api_key = _checked_api_key(api_key)  # before a channel is opened
        self._channel = open_channel(grpc, target, credentials, options, service_config, session_affinity)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)

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
        return self._streamed(self._stub.Generate, _checked_request(request), timeout, metadata, session)

    def complete(
        self,
        request: pb.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> Completion:
        """Runs one request (n = 1) to its end and returns the collected text, tokens, usage and timings.
        Left by an exception (a KeyboardInterrupt), it cancels the call: the server aborts the request."""
        _single(request)
        completion = Completion()
        with self.generate(request, timeout=timeout, metadata=metadata, session=session) as stream:
            for chunk in stream:
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
        """Runs a request with `sampling_params.n` samples to its end: one Completion per sample (as
        `complete`, cancelled when left by an exception)."""
        with self.generate(request, timeout=timeout, metadata=metadata, session=session) as stream:
            return collect_samples(stream)

    def stream_generate(
        self,
        requests: Iterable[pb.StreamGenerateRequest],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> ResponseStream:
        """Many requests on one bidirectional stream; responses are tagged with their request_id. Each of
        `requests` must be a StreamGenerateRequest; an exception that ends them (one raised by their
        iterator, or the TypeError of another item) cancels the call and is raised to its reader."""
        feed = RequestFeed()
        return self._streamed(
            self._stub.StreamGenerate, feed.sync(requests), timeout, metadata, session, feed
        )

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
        self._unary(self._stub.Abort, abort_request(request_id), timeout, metadata, session)

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Tools | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> list[int]:
        """The prompt's token ids, as the server renders and encodes it for `generate_request` of the same
        arguments."""
        request = tokenize_request(
            text,
            messages,
            add_special_tokens,
            tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        return list(self._unary(self._stub.Tokenize, request, timeout, metadata).token_ids)

    def model_info(self, *, timeout: float | None = None, metadata: Metadata = ()) -> pb.GetModelInfoResponse:
        return self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, metadata)

    def _unary(
        self, method: grpc.UnaryUnaryMultiCallable, request: object, timeout: float | None,
        metadata: Metadata = (), session: str | None = None,
    ) -> object:  # fmt: skip
        try:
            return method(request, **_call_options(self._api_key, timeout, metadata, session))
        except grpc.RpcError as error:
            raise SluiceError.from_rpc_error(error) from None

    def _streamed(
        self, method: grpc.UnaryStreamMultiCallable | grpc.StreamStreamMultiCallable, request: object,
        timeout: float | None, metadata: Metadata, session: str | None, feed: RequestFeed | None = None,
    ) -> ResponseStream:  # fmt: skip
        return ResponseStream(
            method(request, **_call_options(self._api_key, timeout, metadata, session)),
            feed,
        )


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
        self._api_key = _checked_api_key(api_key)  # before a channel is opened
        self._channel = open_channel(grpc.aio, target, credentials, options, service_config, session_affinity)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)

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
        return self._streamed(self._stub.Generate, _checked_request(request), timeout, metadata, session)

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
        async with self.generate(request, timeout=timeout, metadata=metadata, session=session) as stream:
            async for chunk in stream:
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
        async with self.generate(request, timeout=timeout, metadata=metadata, session=session) as stream:
            return collect_samples([chunk async for chunk in stream])

    def stream_generate(
        self,
        requests: AsyncIterable[pb.StreamGenerateRequest] | Iterable[pb.StreamGenerateRequest],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> AsyncResponseStream:
        """As `Client.stream_generate`; `requests` may also be an async iterable."""
        feed = RequestFeed()
        return self._streamed(self._stub.StreamGenerate, feed.aio(requests), timeout, metadata, session, feed)

    async def abort(
        self,
        request_id: str,
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        session: str | None = None,
    ) -> None:
        await self._unary(self._stub.Abort, abort_request(request_id), timeout, metadata, session)

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Tools | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
    ) -> list[int]:
        """The prompt's token ids, as the server renders and encodes it for `generate_request` of the same
        arguments."""
        request = tokenize_request(
            text,
            messages,
            add_special_tokens,
            tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
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
            return await method(request, **_call_options(self._api_key, timeout, metadata, session))
        except grpc.RpcError as error:
            raise SluiceError.from_rpc_error(error) from None

    def _streamed(
        self, method: grpc.aio.UnaryStreamMultiCallable | grpc.aio.StreamStreamMultiCallable, request: object,
        timeout: float | None, metadata: Metadata, session: str | None, feed: RequestFeed | None = None,
    ) -> AsyncResponseStream:  # fmt: skip
        return AsyncResponseStream(
            method(request, **_call_options(self._api_key, timeout, metadata, session)),
            feed,
        )
