"""`RequestFeed`: the requests a `stream_generate` call sends, as grpc reads them, checked one by one.

grpc reads a bidirectional call's requests in a thread (grpc.aio: a task) of its own. When the caller's
iterator raises there, grpc cancels the call and the reader saw only UNKNOWN "Exception iterating
requests!" (grpc.aio: CANCELLED "Locally cancelled by application!", the exception logged at DEBUG, so
unseen). The feed keeps that exception, or the TypeError of an item that is no StreamGenerateRequest
(a GenerateRequest sent as one did not parse on the server), and the stream raises it to its reader.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

from sluice.v1 import sluice_pb2 as pb


class RequestFeed:
    """Wraps the caller's requests; `error` is what ended them early (None while they run or ended)."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def sync(self, requests: Iterable[pb.StreamGenerateRequest]) -> Iterator[pb.StreamGenerateRequest]:
        try:
            for request in requests:
                yield _checked(request)
        except Exception as error:  # the caller's; grpc cancels the call on it
            self.error = error
            raise

    async def aio(
        self, requests: AsyncIterable[pb.StreamGenerateRequest] | Iterable[pb.StreamGenerateRequest]
    ) -> AsyncIterator[pb.StreamGenerateRequest]:
        try:
            if isinstance(requests, AsyncIterable):
                async for request in requests:
                    yield _checked(request)
            else:
                for request in requests:
                    yield _checked(request)
        except Exception as error:  # the caller's (not the CancelledError of the call's end)
            self.error = error
            raise


def _checked(request: object) -> pb.StreamGenerateRequest:
    if not isinstance(request, pb.StreamGenerateRequest):
        hint = (
            " (send it as StreamGenerateRequest(generate=request))"
            if isinstance(request, pb.GenerateRequest)
            else ""
        )
        raise TypeError(
            f"requests: each must be a sluice.v1.StreamGenerateRequest, got {type(request).__name__}{hint}"
        )
    return request
