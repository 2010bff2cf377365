"""One StreamGenerate call: many concurrent generation requests multiplexed over a bidirectional stream.

    client ──StreamGenerateRequest──> _read ──generate──> one _pump task per request ──┐
                                            └─cancel────> its RequestCancel            │
    client <──StreamGenerateResponse── run() <── outbox (chunks and in-band errors) <──┘

A request's error goes out in-band (RequestError) and the stream goes on, as does that of a message that
did not parse (under request_id "": it names no request); each request has one span, one refused on
arrival (the server draining, its id empty or in use) too. Half-close lets the outstanding requests
finish, then ends the stream. Cancelling the call cancels every pump, and each
pump's generation iterator aborts its engine request.

A pump hands over one chunk and waits until the call has written it before it reads its request's next
output, so a client that reads slowly gets merged chunks (see RequestStream); a refusal is written
before the next request is read. The outbox holds at most one message per live request and one
refusal: a client that sends and never reads stops being read (it grew by every refused request).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from sluice.service.caller import Caller
from sluice.service.generation import GenerationRunner
from sluice.service.malformed_messages import MalformedMessageError
from sluice.service.request_cancel import ABORT, RequestCancel
from sluice.service.request_ids import RequestIdInUseError, check_request_id, engine_id_of
from sluice.service.status import ServiceUnavailableError, StatusRecorder, cancelled_status, failure_status
from sluice.v1 import sluice_pb2 as pb

# Each request on the stream is counted under its own method label; the call itself under "StreamGenerate".
_METHOD = "StreamGenerate.request"


class StreamSession:
    """Serves one StreamGenerate call. Request ids are the client's, unique among the stream's live
    requests (a duplicate gets ALREADY_EXISTS in-band); each request has its own timeout_seconds. A
    request refused on arrival has its span from `GenerationRunner.refusals`, one let through from the
    runner's `run`."""

    def __init__(
        self,
        runner: GenerationRunner,
        caller: Caller,
        check_accepting: Callable[[], None],
        record_status: StatusRecorder,
    ) -> None:
        self._runner = runner
        self._caller = caller
        self._check_accepting = check_accepting
        self._record_status = record_status
        # Engine ids are namespaced per stream so two streams may both use request_id "1".
        self._prefix = f"stream-{uuid.uuid4().hex[:12]}/"
        # (response, set once written); None ends the call.
        self._outbox: asyncio.Queue[tuple[pb.StreamGenerateResponse, asyncio.Future[None]] | None] = (
            asyncio.Queue()
        )
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._cancels: dict[str, RequestCancel] = {}  # per live request, as long as its pump
        self._tasks: set[asyncio.Task[None]] = set()  # every pump until done (a finished id's too)

    @property
    def num_live_requests(self) -> int:
        """Requests whose last message is not yet written: their pumps until done (a request's id is free
        once its last chunk is queued, `_pumps`, but the drain must wait for the write)."""
        return len(self._tasks)

    async def run(
        self, requests: AsyncIterator[pb.StreamGenerateRequest | MalformedMessageError]
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        """Yields every request's chunks as they come; ends after half-close and the last request. A
        message that did not parse (MalformedMessageError, from sluice.service.malformed_messages) is
        refused in-band like a message without an action."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while (item := await self._outbox.get()) is not None:
                response, written = item
                yield response
                if not written.done():
                    written.set_result(None)
            await reader  # re-raises a failure of the request stream itself
        finally:
            tasks = [reader, *self._tasks]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[pb.StreamGenerateRequest | MalformedMessageError]) -> None:
        try:
            async for message in requests:
                if isinstance(message, MalformedMessageError):  # it names no request: answered under ""
                    await self._send_error("", message)
                    continue
                action = message.WhichOneof("action")
                if action == "generate":
                    if (refused := self._start(message.generate)) is not None:
                        await refused
                elif action == "cancel":
                    await self._cancel(message.cancel.request_id)
                else:
                    await self._send_error("", ValueError("action: set generate or cancel"))
            # Half-closed: let the outstanding requests finish and their last messages be written (their
            # pumps end), then end the stream; ended sooner, it cancelled a pump woken by its last write.
            while live := [task for task in self._tasks if not task.done()]:
                await asyncio.gather(*live, return_exceptions=True)
        finally:
            self._outbox.put_nowait(None)

    def _start(self, request: pb.GenerateRequest) -> asyncio.Future[None] | None:
        """Starts the request's pump; when it is refused, the write of its in-band error instead (and the
        refused request's span: the pump starts the span of a request let through)."""
        request_id = request.request_id
        try:
            with self._runner.refusals(self._caller, request):
                self._check_accepting()
                if not request_id:
                    raise ValueError("request_id: must not be empty on StreamGenerate")
                check_request_id(request_id)
                if request_id in self._pumps:
                    raise RequestIdInUseError(request_id)
        except (ValueError, ServiceUnavailableError, RequestIdInUseError) as exc:
            return self._send_error(request_id, exc)
        cancel = RequestCancel()
        task = asyncio.create_task(self._pump(request, cancel))
        self._pumps[request_id], self._cancels[request_id] = task, cancel
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda done: self._pump_done(request_id, done))
        return None

    async def _cancel(self, request_id: str) -> None:
        """Aborts one live request; its last chunk has FINISH_REASON_ABORT. Unknown or finished ids are
        ignored, since a cancel may race with the request's natural end. Through the request's
        RequestCancel: a request whose long prompt is still being tokenized is not in the engine yet."""
        if (cancel := self._cancels.get(request_id)) is not None:
            await cancel.cancel(ABORT)

    async def _pump(self, request: pb.GenerateRequest, cancel: RequestCancel) -> None:
        request_id = request.request_id
        engine_request_id = engine_id_of(self._prefix, request_id)
        chunks = self._runner.run(request, engine_request_id, self._caller, cancel=cancel)
        unfinished = set(range(request.sampling_params.n if request.sampling_params.HasField("n") else 1))
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk.finish_reason not in (pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_ERROR):
                        unfinished.discard(chunk.index)
                        if not unfinished:  # the client may send its next request of this id on reading it
                            self._forget(request_id, asyncio.current_task())
                    await self._send(pb.StreamGenerateResponse(request_id=request_id, chunk=chunk))
        except asyncio.CancelledError:  # the call ended (cancelled, deadline): so did its requests
            self._record_status(_METHOD, cancelled_status(self._caller.call))
            raise
        except Exception as exc:
            self._forget(request_id, asyncio.current_task())  # ended: its id is free once the error is read
            await self._send_error(request_id, exc)
        else:
            self._record_status(_METHOD, grpc.StatusCode.OK)
        finally:
            # Forgotten by now if its last chunk went out; else (an error, the call cancelled) as it ends.
            self._forget(request_id, asyncio.current_task())

    def _pump_done(self, request_id: str, task: asyncio.Task[None]) -> None:
        """A pump still known here never ran its body, whose end forgets it: the call ended (cancelled
        every pump) before its first step. Its request is counted as the call ended (CANCELLED or
        DEADLINE_EXCEEDED), as a pump cancelled later counts it."""
        if self._pumps.get(request_id) is task:
            if task.cancelled():
                self._record_status(_METHOD, cancelled_status(self._caller.call))
            self._forget(request_id, task)

    def _forget(self, request_id: str, task: asyncio.Task[None] | None) -> None:
        if self._pumps.get(request_id) is task:
            del self._pumps[request_id], self._cancels[request_id]

    def _send(self, response: pb.StreamGenerateResponse) -> asyncio.Future[None]:
        """Queues `response`; the future is done once the call has written it."""
        written = asyncio.get_running_loop().create_future()
        self._outbox.put_nowait((response, written))
        return written

    def _send_error(self, request_id: str, exc: BaseException) -> asyncio.Future[None]:
        """Queues the request's in-band error; the future is done once the call has written it."""
        code, message = failure_status(exc)
        self._record_status(_METHOD, code)
        error = pb.RequestError(code=code.value[0], message=message)
        return self._send(pb.StreamGenerateResponse(request_id=request_id, error=error))
