"""One generation request through the engine: submit, stream chunks, record telemetry, abort if abandoned."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec

from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.engine.outputs import NO_OUTPUT_LOGPROBS, RequestOutput
from sluice.service import convert
from sluice.service.caller import Caller
from sluice.service.generation_spec import GenerationSpec
from sluice.service.metrics import ServerMetrics
from sluice.service.request_cancel import ABORT, TIMEOUT, RequestCancel
from sluice.service.status import RequestFailedError, RequestTimeoutError
from sluice.service.tenant_limits import TenantLimiter, TenantOverLimitError
from sluice.service.tracing import RequestTracer
from sluice.v1 import sluice_pb2 as pb


class GenerationRunner:
    """Runs generation requests on one engine, with their tenant's limits and their telemetry."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        tracer: RequestTracer,
        limiter: TenantLimiter | None = None,
    ) -> None:
        self.engine = engine
        self._metrics = metrics
        self._tracer = tracer
        self._limiter = limiter or TenantLimiter()
        self._timers: set[asyncio.Task[None]] = set()

    async def run(
        self,
        request: pb.GenerateRequest,
        engine_request_id: str,
        caller: Caller,
        *,
        reply_id: str | None = None,
        cancel: RequestCancel | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Streams the request's chunks, each named `reply_id` (default: `request.request_id`, or the
        engine id if empty); what `outputs` raises, after converting the request (ValueError naming a
        bad field)."""
        spec = convert.generation_spec_from_proto(request)
        reply_id = reply_id or request.request_id or engine_request_id
        outputs = self.outputs(spec, engine_request_id, caller, cancel)
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                yield await convert.generate_response(output, reply_id)

    async def outputs(
        self,
        spec: GenerationSpec,
        engine_request_id: str,
        caller: Caller,
        cancel: RequestCancel | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the engine's outputs of one request.

        Raises what the engine raises on validation, TenantOverLimitError, RequestTimeoutError when
        `spec.timeout` passed, and RequestFailedError after the last output if the engine ended the
        request (any of its n samples) with finish_reason "error". `cancel` ends the request from
        outside (Abort): cancelled before it reached the engine, it never does and ends with one
        "abort" output. Closing this iterator early (the handler was cancelled, the deadline passed)
        aborts the engine request (all its samples), freeing its KV blocks. Telemetry records one
        request: the completion tokens of all samples, the finish of the last.
        """
        cancel = cancel or RequestCancel()
        try:
            release = self._limiter.admit(caller.tenant)
        except TenantOverLimitError:
            self._metrics.tenant_rejections.labels(tenant=caller.tenant.name).inc()
            raise
        timer = None if spec.timeout is None else self._start_timer(spec.timeout, cancel)
        try:
            outputs = self._run(spec, engine_request_id, caller, cancel)
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    yield output
        finally:
            if timer is not None:
                timer.cancel()
            release()

    async def _run(
        self, spec: GenerationSpec, engine_request_id: str, caller: Caller, cancel: RequestCancel
    ) -> AsyncIterator[RequestOutput]:
        params = spec.params
        span = self._tracer.start(caller.metadata, spec.prompt.operation, params, spec.trace_context)
        tracker = self._metrics.track(caller.tenant.name)
        final: RequestOutput | None = None
        failed: RequestOutput | None = None
        num_completion_tokens = 0
        last: RequestOutput | None = None
        error: BaseException | None = None
        cancelled = False
        try:
            if cancel.reason == ABORT:  # an Abort came before the request: it never reaches the engine
                final = _aborted(None, engine_request_id)
                yield final
                return
            outputs = await self.engine.add_request(
                engine_request_id,
                params,
                **spec.prompt.as_kwargs(),
                priority=caller.tenant.clamp_priority(spec.priority),
                cache_salt=caller.tenant.cache_salt(spec.cache_salt),
                stream_interval=spec.stream_interval,
                tool_use=spec.tool_use,
                use_speculation=spec.use_speculation,
            )
            cancel.attach(lambda: self.engine.abort(engine_request_id))
            if cancel.cancelled:  # cancelled while the prompt was tokenized
                await self.engine.abort(engine_request_id)
            # aclosing: an abandoned engine stream aborts its request (AsyncEngine contract).
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    if output.invalid_field is not None:  # refused by the core: no chunk, a status
                        raise output.refusal()
                    tracker.on_output(output)
                    last = output
                    if output.finished:
                        final = output
                        failed = output if output.finish_reason == "error" else failed
                        num_completion_tokens += output.usage.completion_tokens if output.usage else 0
                    if final is not None and final.finish_reason == "abort" and cancel.reason == TIMEOUT:
                        raise RequestTimeoutError(
                            f"timeout_seconds: the request's timeout of {spec.timeout:g} s passed"
                        )
                    yield output
            if failed is not None:
                raise RequestFailedError(failed.error or "the engine failed while running the request")
        except (GeneratorExit, asyncio.CancelledError):
            cancelled = True  # the caller left (cancel, deadline, disconnect): an abort, not a failure
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if final is None and cancelled:
                final = _aborted(last, engine_request_id)
            if final is not None and final.usage is not None and params.n > 1:
                usage = msgspec.structs.replace(final.usage, completion_tokens=num_completion_tokens)
                final = msgspec.structs.replace(final, usage=usage)
            tracker.finish(final)
            self._tracer.finish(span, final, error)

    def _start_timer(self, timeout: float, cancel: RequestCancel) -> asyncio.Task[None]:
        async def expire() -> None:
            await asyncio.sleep(timeout)
            await cancel.cancel(TIMEOUT)

        timer = asyncio.get_running_loop().create_task(expire())
        self._timers.add(timer)
        timer.add_done_callback(self._timers.discard)
        return timer

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
    return msgspec.structs.replace(
        last, token_ids=(), text="", logprobs=NO_OUTPUT_LOGPROBS, finish_reason="abort"
    )
