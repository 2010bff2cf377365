"""Async scheduling: step N+1 is scheduled while step N still runs on the device.

A request that samples a token in step N is scheduled in step N+1 with a placeholder for that token
(`PLACEHOLDER_TOKEN_ID`, filled in on the device by the model runner), so `schedule()` counts each
request's tokens still to come from steps in flight, and a step's advance (`num_computed_tokens`) is
taken when it is scheduled, not when its result arrives:

    schedule N     decode at position p (the last known token)          num_computed p + 1, 1 in flight
    schedule N+1   decode at p + 1, token = placeholder                 num_computed p + 2, 2 in flight
    update N       the token of p + 1 appended; stops checked          1 in flight
    update N+1     ...

Each `schedule()` that returns work must be followed, in order, by one `update_from_output()` for it.
An update applies to the request object that was scheduled, if it is still live:
- finished at an earlier update (EOS, stop token, length) or aborted since: the result is discarded
  (its blocks were freed when it finished; the step still in flight writes only K/V nobody reads);
- preempted since (back in the waiting queue, nothing computed): its sampled token is kept, as a
  synchronous engine would have appended it before preempting, and it recomputes later;
- running: tokens appended as usual; only rejected drafts roll `num_computed_tokens` back.
A request whose steps in flight will finish it for sure (max_tokens or max_model_len reached) is not
scheduled again. The full blocks a step computes join the prefix cache by the next `schedule()` (the step
is launched by then: a step that hits them runs after it), as a synchronous scheduler's do. Drafts
(speculative decoding) never follow a placeholder: the core finishes the step in flight before scheduling
requests that speculate (`sluice.engine.core.launched_step`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from sluice.engine.request import Request, RequestStatus
from sluice.engine.scheduler.scheduler import Scheduler
from sluice.engine.scheduler.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput


class AsyncScheduler(Scheduler):
    """`Scheduler` whose `schedule()` may run before the previous step's `update_from_output()`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._num_in_flight: dict[str, int] = {}  # request id -> tokens sampled by steps not yet updated
        # Steps scheduled and not yet updated, oldest first: each with the request objects it scheduled.
        self._steps_in_flight: deque[tuple[SchedulerOutput, dict[str, Request]]] = deque()
        self._owners: dict[str, Request] = {}  # of the step being updated, while it is
        self.num_finished = 0  # requests finished (or aborted) so far: unchanged, every request is live

    def schedule(self) -> SchedulerOutput:
        self._cache_blocks_in_flight()
        out = super().schedule()
        owners, requests, num_in_flight = {}, self._requests, self._num_in_flight
        for scheduled in out.scheduled:
            request_id = scheduled.request_id
            request = requests[request_id]
            request.num_computed_tokens = scheduled.seq_len
            if scheduled.sample:
                num_in_flight[request_id] = num_in_flight.get(request_id, 0) + 1
            owners[request_id] = request
        if out.scheduled:
            self._steps_in_flight.append((out, owners))
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]]
    ) -> list[Request]:
        if not self._steps_in_flight or self._steps_in_flight[0][0] is not out:
            raise ValueError("out: async updates must come in the order the steps were scheduled")
        _, self._owners = self._steps_in_flight.popleft()
        try:
            return super().update_from_output(out, sampled_token_ids)
        finally:
            self._owners = {}  # the step's requests, finished ones included, are not kept past it

    def _cache_blocks_in_flight(self) -> None:
        """Registers in the prefix cache the full blocks that the step in flight (launched: a step that
        hits them runs after it) computes, as a synchronous scheduler has by its next `schedule()`. A
        request whose first slice that step holds (admitted, or resumed after a preemption) would register
        them only at its update, after this `schedule()`: a request sharing its prefix admitted now would
        miss them. Not past a draft (its token may be rejected)."""
        if not self._steps_in_flight:
            return
        out, owners = self._steps_in_flight[-1]
        for scheduled in out.scheduled:
            request = owners[scheduled.request_id]
            if request.status is RequestStatus.RUNNING and not scheduled.spec_token_ids:
                self.kv.cache_computed_blocks(request)

    def discard_steps_in_flight(self) -> None:
        """Forgets the steps scheduled and not yet updated, after an exception cut one short (their
        updates will never come). Only with no request live: theirs would have lost their tokens."""
        if self._requests:
            raise RuntimeError(f"steps in flight discarded with {len(self._requests)} requests live")
        self._steps_in_flight.clear()
        self._num_in_flight.clear()

    def num_in_flight(self, request: Request) -> int:
        """Tokens that steps already scheduled will sample for the request (0 with nothing in flight)."""
        return self._num_in_flight.get(request.request_id, 0)

    # ---- Scheduler hooks ------------------------------------------------------------------------

    def _slice_owner(self, scheduled: ScheduledRequest) -> Request | None:
        request = self._owners.get(scheduled.request_id)
        if request is None or self._requests.get(scheduled.request_id) is not request:
            return None  # finished or aborted since (maybe replaced by a new request with its id)
        return request

    def _accept(self, request: Request, scheduled: ScheduledRequest, token_ids: Sequence[int]) -> None:
        self._num_in_flight[request.request_id] -= 1  # before a stop finishes it
        super()._accept(request, scheduled, token_ids)

    def _chunk_computed(self, request: Request, scheduled: ScheduledRequest) -> None:
        if request.status is RequestStatus.RUNNING:  # counted at schedule time; now its K/V exists
            self.kv.cache_computed_blocks(request)

    def _set_computed(self, request: Request, scheduled: ScheduledRequest, num_computed: int) -> None:
        # The slice's advance was taken when it was scheduled (later slices may be counted too); only
        # rejected drafts roll it back. A preempted request computes again from 0.
        if request.status is RequestStatus.RUNNING:
            request.num_computed_tokens += num_computed - scheduled.seq_len

    def _num_tokens(self, request: Request) -> int:
        return request.num_tokens + self._num_in_flight.get(request.request_id, 0)

    def _token_ids(self, request: Request, start: int, end: int) -> tuple[int, ...]:
        num_tokens = request.num_tokens
        if end <= num_tokens:
            return super()._token_ids(request, start, end)
        if start >= num_tokens:  # a decode of the token in flight
            return (PLACEHOLDER_TOKEN_ID,) * (end - start)
        return super()._token_ids(request, start, num_tokens) + (PLACEHOLDER_TOKEN_ID,) * (end - num_tokens)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        if self._finishes_in_flight(request):
            return 0
        return super()._num_new_tokens(request, num_computed, budget)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        super()._finish(request, status)
        self._num_in_flight.pop(request.request_id, None)
        self.num_finished += 1

    def _finishes_in_flight(self, request: Request) -> bool:
        """The steps in flight end the request whatever they sample: max_tokens or max_model_len."""
        num_in_flight = self.num_in_flight(request)
        if num_in_flight == 0:
            return False
        max_tokens = request.sampling_params.max_tokens
        return (
            request.num_output_tokens + num_in_flight >= max_tokens
            or request.num_tokens + num_in_flight >= self.max_model_len
        )
