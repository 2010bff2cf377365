"""How a benchmark request reaches the server: one streaming Generate call per request, or every
request multiplexed on a single bidirectional StreamGenerate call.

A transport's `generate(request_id, request)` is an async iterator of `Chunk`s as they arrive: the
number of tokens in each, and on the last the server's count of prompt tokens served from its prefix
cache; a failed request raises `BenchError` with a status code name.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from sluice.bench.workloads import BenchRequest
from sluice.client import AsyncClient, SluiceError, generate_request
from sluice.v1 import sluice_pb2 as pb

_GOOD_FINISH = (pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


class BenchError(Exception):
    """A request that failed: `code` is a gRPC status name or a FinishReason name such as
    "FINISH_REASON_ABORT"."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class Chunk:
    """One response of a request. `cached_tokens` / `prompt_tokens_computed`: on the last chunk, the
    prompt tokens the server served from its prefix cache and those it ran through the model (the
    proto's Usage); None on the others, and from a server that does not report them."""

    num_tokens: int
    cached_tokens: int | None = None
    prompt_tokens_computed: int | None = None


class Transport(Protocol):
    def generate(self, request_id: str, request: BenchRequest) -> AsyncIterator[Chunk]: ...

    async def close(self) -> None: ...


def bench_generate_request(request_id: str, request: BenchRequest) -> pb.GenerateRequest:
    """Greedy, EOS ignored: the output has exactly `request.output_len` tokens."""
    return generate_request(
        token_ids=request.prompt_token_ids,
        request_id=request_id,
        temperature=0.0,
        max_tokens=request.output_len,
        ignore_eos=True,
    )


def bench_chunk(response: pb.GenerateResponse) -> Chunk | None:
    """The chunk a response carries (None: no tokens and no usage); a failed finish raises BenchError."""
    if response.finish_reason not in _GOOD_FINISH:
        raise BenchError(pb.FinishReason.Name(response.finish_reason))
    if not response.HasField("usage"):
        return Chunk(len(response.token_ids)) if response.token_ids else None
    usage = response.usage
    return Chunk(len(response.token_ids), usage.cached_tokens, usage.prompt_tokens_computed)


class GenerateTransport:
    """One server-streaming Generate call per request."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def generate(self, request_id: str, request: BenchRequest) -> AsyncIterator[Chunk]:
        try:
            async for response in self._client.generate(bench_generate_request(request_id, request)):
                if chunk := bench_chunk(response):
                    yield chunk
        except SluiceError as error:
            raise BenchError(error.code.name, error.message) from None

    async def close(self) -> None:
        await self._client.close()


class StreamTransport:
    """All requests on one StreamGenerate call; a reader task routes responses by request_id."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._outbox: asyncio.Queue[pb.StreamGenerateRequest | None] = asyncio.Queue()
        self._inboxes: dict[str, asyncio.Queue[pb.StreamGenerateResponse | BenchError]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ended: tuple[str, str] | None = None  # (code, message) once the call has ended

    async def generate(self, request_id: str, request: BenchRequest) -> AsyncIterator[Chunk]:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        if self._ended is not None:
            raise BenchError(*self._ended)
        inbox: asyncio.Queue[pb.StreamGenerateResponse | BenchError] = asyncio.Queue()
        self._inboxes[request_id] = inbox
        self._outbox.put_nowait(
            pb.StreamGenerateRequest(generate=bench_generate_request(request_id, request))
        )
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, BenchError):
                    raise item
                if item.HasField("error"):
                    raise BenchError(_code_name(item.error.code), item.error.message)
                if chunk := bench_chunk(item.chunk):
                    yield chunk
                if item.chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    return
        finally:
            self._inboxes.pop(request_id, None)

    async def _requests(self) -> AsyncIterator[pb.StreamGenerateRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        """Routes responses to their requests. Once the call ends, the requests still waiting and every
        later one fail with its status, so none waits for a response that cannot come."""
        ended = ("CANCELLED", "the StreamGenerate call ended")
        try:
            async for response in self._client.stream_generate(self._requests()):
                if (inbox := self._inboxes.get(response.request_id)) is not None:
                    inbox.put_nowait(response)
        except SluiceError as error:
            ended = (error.code.name, error.message)
        finally:
            self._ended = ended
            for inbox in self._inboxes.values():
                inbox.put_nowait(BenchError(*ended))

    async def close(self) -> None:
        """Half-closes the stream, waits for the server to end it, and closes the channel."""
        if self._reader is not None:
            self._outbox.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._client.close()


def _code_name(code: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))
