"""One generation request through the engine: submit, stream chunks, record telemetry, abort if abandoned."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from engine.errors import InvalidRequestError
from engine.frontend.async_engine import AsyncEngine
from engine.outputs import RequestOutput
from service import convert
from service.metrics import ServerMetrics
from service.status import RequestFailedError
from service.stubs import sluice_pb2 as pb
from service.tracing import RequestTracer


class GenerationRunner:
    """Runs generation requests on one engine, with their telemetry."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, tracer: RequestTracer) -> None:
        self.engine = engine
        self._metrics = metrics
        self._tracer = tracer

    async def run(
        self,
        request: pb.GenerateRequest,
        engine_request_id: str,
        metadata: Sequence[tuple[str, str | bytes]],
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Streams the request's chunks, each named `request.request_id` (or the engine id if empty).

        Raises what the engine raises on validation, and RequestFailedError after the last chunk if the
        engine ended the request with finish_reason "error". Closing this iterator early (the handler
        was cancelled, the deadline passed) aborts the engine request, freeing its KV blocks.
        """
        params = convert.sampling_params_from_proto(request.sampling_params)
        prompt = convert.prompt_from_proto(request)
        tool_use = convert.tool_use_from_proto(request)
        reply_id = request.request_id or engine_request_id
        span = self._tracer.start(metadata, prompt.operation, params)
        tracker = self._metrics.track()
        final: RequestOutput | None = None
        last: RequestOutput | None = None
        error: BaseException | None = None
        cancelled = False
        try:
            outputs = await self.engine.add_request(
                engine_request_id,
                params,
                **prompt.as_kwargs(),
                priority=request.priority,
                cache_salt=request.cache_salt or None,
                stream_interval=request.stream_interval or None,
                tool_use=tool_use,
                use_speculation=not request.disable_speculation,
            )
            # aclosing: an abandoned engine stream aborts its request (AsyncEngine contract).
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    if output.invalid_field is not None:  # refused by the core: no chunk, a status
                        raise InvalidRequestError(output.invalid_field, output.error.partition(": ")[2])
                    tracker.on_output(output)
                    last = output
                    final = output if output.finished else final
                    yield convert.generate_response_from_output(output, reply_id)
            if final is not None and final.finish_reason == "error":
                raise RequestFailedError(final.error or "the engine failed while running the request")
        except (GeneratorExit, asyncio.CancelledError):
            cancelled = True  # the caller left (cancel, deadline, disconnect): an abort, not a failure
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if final is None and cancelled:
                final = _aborted(last, engine_request_id)
            tracker.finish(final)
            self._tracer.finish(span, final, error)

    async def abort_all(self) -> int:
        """Aborts every live request (their streams end with FINISH_REASON_ABORT); returns how many."""
        live = self.engine.live_request_ids()
        for request_id in live:
            await self.engine.abort(request_id)
        return len(live)


def _aborted(last: RequestOutput | None, request_id: str) -> RequestOutput:
    """The final output of a request whose caller left: its latest usage, finish_reason "abort"."""
    if last is None:
        return RequestOutput(request_id=request_id, token_ids=(), text="", finish_reason="abort")
    return dataclasses.replace(last, token_ids=(), text="", logprobs=(), finish_reason="abort")
