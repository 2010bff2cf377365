"""One generation request through the engine: submit, stream chunks, record telemetry, abort if abandoned."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping

import msgspec

from sluice.engine.errors import QueueFullError
from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.engine.outputs import NO_OUTPUT_LOGPROBS, RequestOutput, Timings
from sluice.service import convert
from sluice.service.caller import Caller
from sluice.service.generation_spec import GenerationSpec
from sluice.service.metrics import ServerMetrics
from sluice.service.request_cancel import ABORT, TIMEOUT, RequestCancel
from sluice.service.status import RequestFailedError, RequestTimeoutError
from sluice.service.tenant_limits import TenantLimiter, TenantOverLimitError
from sluice.service.tracing import RequestSpan, RequestTracer
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
        self._cancels: set[RequestCancel] = set()  # of the requests in `outputs`, engine or not yet
        self._stopping = False  # `abort_all` ran: requests that come later are aborted on arrival

    def trace(
        self, caller: Caller, operation: str, trace_context: Mapping[str, str] | None = None
    ) -> RequestSpan:
        """The span of one request, to open (`with`) around its whole generation path, conversion
        included, so that a request refused anywhere on it has one too (see RequestSpan)."""
        return self._tracer.start(caller.call, operation, trace_context)

    def refusals(
        self, caller: Caller, request: pb.GenerateRequest
    ) -> contextlib.AbstractContextManager[None]:
        """Around the checks `request` passes before `run` starts its span: one span if they refuse it
        (RequestTracer.refusals)."""
        return self._tracer.refusals(caller.call, operation_of(request), dict(request.trace_context))

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
        reply_id = reply_id or request.request_id or engine_request_id
        with self.trace(caller, operation_of(request), dict(request.trace_context)) as span:
            spec = convert.generation_spec_from_proto(request)
            outputs = self.outputs(spec, engine_request_id, caller, span, cancel)
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    yield await convert.generate_response(output, reply_id)

    async def outputs(
        self,
        spec: GenerationSpec,
        engine_request_id: str,
        caller: Caller,
        span: RequestSpan,
        cancel: RequestCancel | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the engine's outputs of one request, recording them on its (open) `span`.

        Raises what the engine raises on validation, TenantOverLimitError, RequestTimeoutError when
        `spec.timeout` passed, and RequestFailedError after the last output if the engine ended the
        request (any of its n samples) with finish_reason "error". `cancel` ends the request from
        outside (Abort): cancelled before it reached the engine, it never does, and each of its n
        samples ends with an "abort" output. Closing this iterator early (the handler was cancelled,
        the deadline passed) aborts the engine request (all its samples), freeing its KV blocks.
        Telemetry records one request: the completion tokens and preemptions of all samples, finished or
        not, each sample's finish ("abort" for those the caller left before they finished). The tenant's
        slot is free before the last output is handed on (a caller may send its next request on it), and
        a request aborted before it came takes none (nor a rate token); one refused for a full queue
        gives its rate token back.
        """
        span.record_params(spec.params)
        cancel = cancel or RequestCancel()
        if self._stopping:
            await cancel.cancel(ABORT)
        if cancel.reason == ABORT:  # it never reaches the engine (`_run`)
            release = _nothing_to_release
        else:
            try:
                release = self._limiter.admit(caller.tenant)
            except TenantOverLimitError:
                self._metrics.tenant_rejections.labels(tenant=caller.tenant.name).inc()
                raise
        timer = None if spec.timeout is None else self._start_timer(spec.timeout, cancel)
        self._cancels.add(cancel)
        try:
            outputs = self._run(spec, engine_request_id, caller, cancel, span, release)
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    yield output
        except QueueFullError:  # the server's load, not the tenant's: its retry finds the token back
            self._limiter.refund(caller.tenant)
            raise
        finally:
            self._cancels.discard(cancel)
            if timer is not None:
                timer.cancel()
            release()

    async def _run(
        self,
        spec: GenerationSpec,
        engine_request_id: str,
        caller: Caller,
        cancel: RequestCancel,
        span: RequestSpan,
        release: Callable[[], None],
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs; `release` (the tenant's slot) is called once every sample finished,
        before the last output goes on."""
        tracker = self._metrics.track(caller.tenant.name)
        progress = RequestProgress(engine_request_id, spec.params.n)
        caller_left = False
        try:
            outputs = await self._add_request(spec, engine_request_id, caller, cancel)
            if outputs is None:  # cancelled before it reached the engine: it never does
                for index in range(spec.params.n):  # each sample ends, as the engine's abort ends them
                    aborted = msgspec.structs.replace(progress.aborted(), index=index)
                    progress.add(aborted)
                    if progress.all_finished:
                        release()  # before the last output goes on, as below
                    if cancel.reason == TIMEOUT:
                        raise _timeout_error(spec)
                    yield aborted
                return
            # aclosing: an abandoned engine stream aborts its request (AsyncEngine contract).
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    if output.invalid_field is not None:  # refused by the core: no chunk, a status
                        raise output.refusal()
                    tracker.on_output(output)
                    progress.add(output)
                    if progress.all_finished:
                        release()
                    if output.finish_reason == "abort" and cancel.reason == TIMEOUT:
                        raise _timeout_error(spec)
                    yield output
            progress.raise_if_failed()
        except (GeneratorExit, asyncio.CancelledError):
            caller_left = True  # the caller left (cancel, deadline, disconnect): an abort, not a failure
            raise
        finally:
            final = progress.final_output(caller_left)
            if final is not None:
                finish_reasons = progress.finish_reasons(final)
                tracker.finish(final, finish_reasons)
                span.record_final(final, finish_reasons)

    async def _add_request(
        self, spec: GenerationSpec, engine_request_id: str, caller: Caller, cancel: RequestCancel
    ) -> AsyncIterator[RequestOutput] | None:
        """Submits the request, and returns its outputs; `cancel` aborts it from then on. None when it was
        cancelled before it reached the engine: before it came (an early Abort) or while its prompt was
        tokenized (a long one takes a thread seconds; the cancel ends the call at once, and what the
        thread returns is dropped, never sent to the engine)."""
        if cancel.cancelled:
            return None
        adding = asyncio.ensure_future(
            self.engine.add_request(
                engine_request_id,
                spec.params,
                **spec.prompt.as_kwargs(),
                priority=caller.tenant.clamp_priority(spec.priority),
                cache_salt=caller.tenant.cache_salt(spec.cache_salt),
                stream_interval=spec.stream_interval,
                tool_use=spec.tool_use,
                use_speculation=spec.use_speculation,
            )
        )

        def reached_engine() -> bool:
            return adding.done() and not adding.cancelled() and adding.exception() is None

        async def stop_adding() -> None:
            if reached_engine():  # a moment ago, and this coroutine has not resumed yet
                await self.engine.abort(engine_request_id)
            else:
                adding.cancel()  # `add_request` sends to the engine after its last await: all or nothing

        cancel.attach(stop_adding)
        try:
            await asyncio.wait((adding,))
        except asyncio.CancelledError:  # the caller left
            if reached_engine():
                await adding.result().aclose()  # aborted there
            adding.cancel()
            raise
        if adding.cancelled():
            if cancel.cancelled:
                return None
            raise asyncio.CancelledError  # cancelled by another than `cancel` (the loop shutting down)
        outputs = adding.result()
        cancel.attach(lambda: self.engine.abort(engine_request_id))
        return outputs

    def _start_timer(self, timeout: float, cancel: RequestCancel) -> asyncio.Task[None]:
        async def expire() -> None:
            await asyncio.sleep(timeout)
            await cancel.cancel(TIMEOUT)

        timer = asyncio.get_running_loop().create_task(expire())
        self._timers.add(timer)
        timer.add_done_callback(self._timers.discard)
        return timer

    async def abort_all(self) -> int:
        """Aborts every live request, in the engine or not yet (a long prompt still being tokenized),
        and every one that comes later: their streams end with FINISH_REASON_ABORT, those in the engine
        at once (not after the core's step under way, which may outlast the drain). Returns how many
        were live."""
        self._stopping = True
        live = [cancel for cancel in self._cancels if not cancel.cancelled]
        self.engine.abort_all_now()
        for cancel in live:
            await cancel.cancel(ABORT)
        return len(live)


def _timeout_error(spec: GenerationSpec) -> RequestTimeoutError:
    return RequestTimeoutError(f"timeout_seconds: the request's timeout of {spec.timeout:g} s passed")


def _nothing_to_release() -> None:
    """The release of a request that took no tenant slot."""


def operation_of(request: pb.GenerateRequest) -> str:
    """The gen_ai.operation.name of `request` (as its converted Prompt names it), read before conversion."""
    return "chat" if request.WhichOneof("prompt") == "messages" else "text_completion"


class RequestProgress:
    """What a request's n samples have produced so far: the latest output of each (by `index`), finished
    or not, whose usage counts that sample's tokens to date."""

    def __init__(self, request_id: str, num_samples: int) -> None:
        self._request_id = request_id
        self._num_samples = num_samples
        self._arrival = time.time()  # for a request that ends before the engine reports its own
        self._latest: dict[int, RequestOutput] = {}
        self._last: RequestOutput | None = None
        self._last_finished: RequestOutput | None = None
        self._failed: RequestOutput | None = None  # a sample's output with finish_reason "error"

    def add(self, output: RequestOutput) -> None:
        self._latest[output.index] = output
        self._last = output
        if output.finished:
            self._last_finished = output
            if output.finish_reason == "error":
                self._failed = output

    def raise_if_failed(self) -> None:
        """RequestFailedError if the engine ended any sample with finish_reason "error"."""
        if self._failed is not None:
            raise RequestFailedError(self._failed.error or "the engine failed while running the request")

    @property
    def all_finished(self) -> bool:
        return sum(output.finished for output in self._latest.values()) == self._num_samples

    def aborted(self) -> RequestOutput:
        """The final output of a request ended before its samples finished: finish_reason "abort", the
        latest output's usage and timings, finished now."""
        now = time.time()
        last = self._last
        if last is None or last.timings is None:
            timings = Timings(arrival=self._arrival, first_scheduled=None, first_token=None, finished=now)
        else:
            timings = msgspec.structs.replace(last.timings, finished=now)
        if last is None:
            return RequestOutput(
                request_id=self._request_id, token_ids=(), text="", finish_reason="abort", timings=timings
            )
        return msgspec.structs.replace(
            last,
            token_ids=(),
            text="",
            reasoning="",
            logprobs=NO_OUTPUT_LOGPROBS,
            finish_reason="abort",
            timings=timings,
        )

    def final_output(self, caller_left: bool) -> RequestOutput | None:
        """The request's final output, with the completion tokens and preemptions of all its samples: the
        last sample's to finish; an "abort" one if the caller left before all finished; None if none
        finished otherwise (refused or failed before any did).

        Its prompt counts once, as sample 0 ran it: `cached_tokens` are sample 0's, whichever sample
        finished last. The later samples hit the blocks sample 0 just computed (`ParallelSampling`), a
        hit the request gave itself, as a request resumed after preemption does."""
        final = self.aborted() if caller_left and not self.all_finished else self._last_finished
        if final is None:
            return None
        outputs = self._latest.values()
        num_preemptions = sum(output.num_preemptions for output in outputs)
        final = msgspec.structs.replace(final, timings=self._first_timings(final.timings))
        if final.usage is None:
            return msgspec.structs.replace(final, num_preemptions=num_preemptions)
        num_tokens = sum(output.usage.completion_tokens for output in outputs if output.usage is not None)
        first = self._latest.get(0)
        num_cached = first.usage.cached_tokens if first is not None and first.usage is not None else 0
        usage = msgspec.structs.replace(final.usage, completion_tokens=num_tokens, cached_tokens=num_cached)
        return msgspec.structs.replace(final, usage=usage, num_preemptions=num_preemptions)

    def finish_reasons(self, final: RequestOutput) -> tuple[str, ...]:
        """Each sample's finish reason, by index: its own where it finished, the request's (`final`'s,
        "abort" when the caller left) where it was cut short."""
        reasons = []
        for index in range(self._num_samples):
            output = self._latest.get(index)
            finished = output is not None and output.finished
            reasons.append(output.finish_reason if finished else final.finish_reason)
        return tuple(reasons)

    def _first_timings(self, timings: Timings | None) -> Timings | None:
        """`timings` with the request's first scheduling and first token: the earliest of any sample's
        (the caller got its first token then), not the last finished sample's own."""
        if timings is None:
            return None
        samples = [output.timings for output in self._latest.values() if output.timings is not None]
        scheduled = [t.first_scheduled for t in samples if t.first_scheduled is not None]
        first_tokens = [t.first_token for t in samples if t.first_token is not None]
        return msgspec.structs.replace(
            timings,
            first_scheduled=min(scheduled, default=timings.first_scheduled),
            first_token=min(first_tokens, default=timings.first_token),
        )
