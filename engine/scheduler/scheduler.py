"""Continuous batching under one token budget, with prefix caching, priorities and preemption.

Each step every request advances from `num_computed_tokens` towards `num_tokens`; there are no prefill
or decode modes. A decode is an advance of 1, a prefill chunk an advance of many, a prefix-cache hit an
advance taken for free at admission. `schedule()` fills the budget with running requests first, in the
order they were admitted (as vLLM's: a long prompt admitted later, whatever its priority, takes what the
decodes before it leave, and never stalls them), then admits waiting ones in (priority, arrival,
sequence) order. Priority picks who is admitted and who is preempted, not who decodes.

A request in decode with draft tokens (speculative decoding, `Request.spec_token_ids`) advances by
1 + k: its last token and k drafts, all under the same budget and with KV slots reserved for them. Drafts
are given after every running request's own tokens, from the budget and free blocks those leave: a
request's drafts never keep another running request from advancing, nor preempt one. The step's result
says how many drafts were accepted: `num_computed_tokens` then covers only the accepted
ones (the rejected positions' KV is garbage to be overwritten), blocks past the request's tokens are
freed, and the prefix cache registers only blocks full of accepted tokens.

When a running request needs a block and none is free, the worst running request (largest priority
value, then newest) is preempted by recompute: its blocks are freed, `num_computed_tokens` drops to 0,
it keeps its output tokens and returns to the waiting queue in its original place.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.errors import ContextLengthError
from sluice.engine.kv_cache.kv_cache_manager import KVCacheManager, PrefixHit
from sluice.engine.request import Request, RequestStatus
from sluice.engine.scheduler.request_queue import RequestQueue
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class _StepPlan:
    """What one `schedule()` call has decided so far."""

    token_budget: int
    num_new_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step
    block_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    spec_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)  # drafts, beyond num_new
    preempted: list[str] = field(default_factory=list)

    def add(self, request_id: str, num_new_tokens: int, block_ids: tuple[int, ...]) -> None:
        self.num_new_tokens[request_id] = num_new_tokens
        self.block_ids[request_id] = block_ids
        self.spec_token_ids[request_id] = ()
        self.token_budget -= num_new_tokens

    def add_drafts(self, request_id: str, block_ids: tuple[int, ...], spec: tuple[int, ...]) -> None:
        """Drafts after a request's scheduled tokens; `block_ids` now holds their slots too."""
        self.block_ids[request_id] = block_ids
        self.spec_token_ids[request_id] = spec
        self.token_budget -= len(spec)

    def unschedule(self, request_id: str) -> None:
        self.token_budget += self.num_new_tokens.pop(request_id, 0)
        self.token_budget += len(self.spec_token_ids.pop(request_id, ()))
        self.block_ids.pop(request_id, None)


class Scheduler:
    """Decides, each step, which requests advance by how many tokens. Pure Python, no torch."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        sliding_window: int | None = None,
    ) -> None:
        """sliding_window: the model's window when every layer has it (ModelArchConfig.
        uniform_sliding_window); a request then holds only the blocks its window reaches.
        scheduler_config's step budget is set (the model runner sets a default one for its device:
        `with_step_budget`)."""
        if scheduler_config.max_num_batched_tokens is None:
            raise ValueError("max_num_batched_tokens: unset; the model runner sets it for its device")
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(
            self.block_size, num_blocks, cache_config.enable_prefix_caching, sliding_window
        )
        longest = self.kv.num_blocks_needed(max_model_len, scheduler_config.max_num_batched_tokens)
        if longest > num_blocks:  # vLLM refuses to start; here each request that cannot fit is refused
            logger.warning(
                "the KV cache's %d blocks hold less than one request of max_model_len %d (%d blocks): "
                "a request whose prompt + max_tokens needs more is refused "
                "(max_tokens or prompt, RESOURCE_EXHAUSTED)",
                num_blocks,
                max_model_len,
                longest,
            )
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting = RequestQueue()
        self._running: dict[str, Request] = {}
        self._run_order: list[Request] | None = None  # _running in admission order; None: changed since
        self._seq: dict[str, int] = {}  # insertion sequence, the last tie-breaker
        self._next_seq = itertools.count()
        self._finished_since_schedule: list[str] = []
        self._num_preemptions = 0
        # Request id -> its block table as allocate_slots last returned it. A decode whose table has room
        # reuses it: no KV-manager call, and the same tuple object each step. Dropped wherever the table
        # can change other than by growing: freed (finish, preemption), rejected drafts' blocks freed.
        # Not kept with a window: the window frees blocks as the request advances.
        self._tables: dict[str, tuple[int, ...]] = {}
        self._keeps_tables = sliding_window is None

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; it can join the next step. Raises if it could never be scheduled."""
        if request.request_id in self._requests:
            raise ValueError(f"request_id: {request.request_id!r} is already live")
        self._check_fits(request)
        self._requests[request.request_id] = request
        self._seq[request.request_id] = next(self._next_seq)
        request.status = RequestStatus.WAITING
        self._waiting.push(request, self._seq[request.request_id], request.num_tokens)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort live requests in any state and free their blocks now; unknown ids are skipped."""
        aborted = (self.finish_request(rid, RequestStatus.FINISHED_ABORTED) for rid in request_ids)
        return [request for request in aborted if request is not None]

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a live request with `status` (e.g. a stop string hit) and free its blocks."""
        if not status.finished:
            raise ValueError(f"status: {status} is not a finished status")
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, status)
        return request

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_finished_requests(self) -> bool:
        """Requests finished since the last `schedule()`, whose ids the next one hands out
        (`finished_request_ids`, for the engine to drop their state; vLLM's `has_finished_requests`)."""
        return bool(self._finished_since_schedule)

    # ---- stats (read by the engine's EngineStats) --------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests have yet to compute: their prompts (and a preempted request's
        outputs so far), some of which the prefix cache may hold."""
        return self._waiting.num_tokens

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache at a request's first admission."""
        return self.kv.num_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens found cached at a request's first admission (never a request's last token)."""
        return self.kv.num_hits

    @property
    def prefix_cache_preempted_queries(self) -> int:
        """Tokens looked up in the prefix cache by requests resumed after preemption."""
        return self.kv.num_preempted_queries

    @property
    def prefix_cache_preempted_hits(self) -> int:
        """Tokens found cached by requests resumed after preemption (their own blocks, if not evicted)."""
        return self.kv.num_preempted_hits

    @property
    def prefix_cache_evictions(self) -> int:
        """Cached blocks whose hash was dropped because the block was reallocated."""
        return self.kv.pool.num_evictions

    @property
    def num_blocks_total(self) -> int:
        return self.kv.pool.num_blocks

    @property
    def num_blocks_used(self) -> int:
        return self.kv.pool.num_used_blocks

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones, all under one token budget."""
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        # A step that had to preempt is short of blocks: admitting new work would only thrash.
        if not plan.preempted:
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]]
    ) -> list[Request]:
        """Apply a step's results: advance computed tokens, append sampled tokens, finish stopped requests.

        `sampled_token_ids[request_id]` are the tokens a sampling slice produced: its accepted drafts
        (a prefix of its `spec_token_ids`) then one token sampled by the target model. Stops are checked
        at every token; a stop in the middle truncates the run. Returns the requests that got tokens this
        step, finished ones included. Requests aborted or finished since `schedule()` are skipped.
        """
        got_token = []
        for scheduled in out.scheduled:
            request = self._slice_owner(scheduled)
            if request is None:
                continue
            if request.spec_token_ids:
                request.spec_token_ids = []
            if not scheduled.sample:
                self._chunk_computed(request, scheduled)
                continue
            self._accept(request, scheduled, sampled_token_ids[scheduled.request_id])
            got_token.append(request)
        return got_token

    def _accept(self, request: Request, scheduled: ScheduledRequest, token_ids: Sequence[int]) -> None:
        """Append a sampling slice's tokens; roll back the KV of rejected drafts; finish on a stop."""
        num_drafts = len(scheduled.spec_token_ids)
        num_accepted = len(token_ids) - 1
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(
                f"sampled_token_ids: request {request.request_id!r} got {len(token_ids)} tokens "
                f"for {num_drafts} drafts"
            )
        num_tokens_before = request.num_tokens
        status = request.append_output_tokens(token_ids, self.max_model_len)
        num_appended = request.num_tokens - num_tokens_before
        # K/V is valid for the slice's own tokens and the accepted drafts; the last token has none yet.
        self._set_computed(
            request,
            scheduled,
            min(scheduled.start_position + len(scheduled.token_ids) + num_accepted, request.num_tokens - 1),
        )
        request.num_draft_tokens += num_drafts
        request.num_accepted_draft_tokens += min(num_accepted, num_appended)
        if request.times.first_token is None:
            request.times.first_token = time.time()
        self.kv.cache_computed_blocks(request)
        if status is not None:
            self._finish(request, status)
        elif num_drafts and self.kv.free_blocks_beyond(request.request_id, request.num_computed_tokens):
            self._tables.pop(request.request_id, None)  # else the table the scheduler keeps holds

    # ---- what a step's result applies to (async scheduling overrides these: async_scheduler.py) ----

    def _slice_owner(self, scheduled: ScheduledRequest) -> Request | None:
        """The request a slice's result applies to: still running from where the slice started."""
        request = self._running.get(scheduled.request_id)
        if request is None or request.num_computed_tokens != scheduled.start_position:
            return None
        return request

    def _chunk_computed(self, request: Request, scheduled: ScheduledRequest) -> None:
        """A prefill chunk that produced no token ran: its K/V is in the cache."""
        request.num_computed_tokens += scheduled.num_tokens
        self.kv.cache_computed_blocks(request)

    def _set_computed(self, request: Request, scheduled: ScheduledRequest, num_computed: int) -> None:
        """A sampling slice ran: `num_computed` tokens have K/V (the slice's, less rejected drafts)."""
        request.num_computed_tokens = num_computed

    def _num_tokens(self, request: Request) -> int:
        """The tokens the request will have once every step already scheduled has run."""
        return request.num_tokens

    def _token_ids(self, request: Request, start: int, end: int) -> tuple[int, ...]:
        """The request's tokens at positions start .. end - 1."""
        return request.token_slice(start, end)

    # ---- schedule() helpers --------------------------------------------------------------------

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Decodes and continuing prefill chunks, in admission order; preempts the worst running request
        (`_order_key`) when blocks run out. Then drafts, from what the running requests' own tokens left
        (`_schedule_drafts`). In priority order, a better-priority prompt's chunks took the whole budget
        step after step, and the requests decoding beside it got no token until its prefill ended."""
        if self._run_order is None:
            self._run_order = list(self._running.values())  # a copy: a preemption changes _running
        for request in self._run_order:
            if plan.token_budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
            if num_new == 0:
                continue
            block_ids = self._allocate_or_preempt(request, num_new, plan)
            if block_ids is not None:
                plan.add(request.request_id, num_new, block_ids)
        self._schedule_drafts(plan)

    def _schedule_drafts(self, plan: _StepPlan) -> None:
        """Drafts for the running requests scheduled so far, in run order, within the budget and
        the free blocks left: a request whose drafts find no free block just decodes (drafts never
        preempt, nor take the budget or blocks of another running request's own tokens)."""
        for request_id, num_new in list(plan.num_new_tokens.items()):  # in run order
            if plan.token_budget == 0:
                break
            request = self._running[request_id]
            spec = self._spec_tokens(request, num_new, plan.token_budget)
            block_ids = self._allocate_slots(request, num_new + len(spec)) if spec else None
            if block_ids is not None:
                plan.add_drafts(request_id, block_ids, spec)

    def _spec_tokens(self, request: Request, num_new: int, budget: int) -> tuple[int, ...]:
        """The drafts a request verifies this step: only in decode (the step reaches its last token),
        within `budget` (the step's tokens left for drafts), max_model_len and the outputs it may still
        produce (k drafts yield up to k + 1 tokens)."""
        if not request.spec_token_ids or request.num_computed_tokens + num_new != request.num_tokens:
            return ()
        limit = min(
            budget,
            self.max_model_len - request.num_tokens,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
        )
        return tuple(request.spec_token_ids[: max(limit, 0)])

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan) -> tuple[int, ...] | None:
        """Blocks for `num_new` more tokens, preempting the worst running requests until they fit.
        None if `request` itself was the one preempted."""
        while True:
            block_ids = self._allocate_slots(request, num_new)
            if block_ids is not None:
                return block_ids
            victim = self._worst_running()
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _allocate_slots(self, request: Request, num_new: int) -> tuple[int, ...] | None:
        """`kv.allocate_slots` for a running request, skipped when its table already has room."""
        table = self._tables.get(request.request_id)
        if table is not None and request.num_computed_tokens + num_new <= len(table) * self.block_size:
            return table
        table = self.kv.allocate_slots(request, num_new)
        if table is not None and self._keeps_tables:
            self._tables[request.request_id] = table
        return table

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in queue order while budget, sequences and blocks allow.

        Strict queue order: when the head cannot be admitted, nothing behind it is, unless a running
        request of strictly worse priority can be preempted to make room for it.
        """
        while self._waiting and plan.token_budget > 0:
            request = self._waiting.peek()
            if request.request_id in plan.preempted:
                break  # it just lost its blocks in this step; let it retry next step
            if len(self._running) >= self.config.max_num_seqs:
                if self._preempt_for(request, plan):
                    continue
                break
            hit = self.kv.find_prefix(request)
            num_new = self._num_new_tokens(request, hit.num_tokens, plan.token_budget)
            if num_new == 0:
                break
            block_ids = self.kv.allocate_slots(request, num_new, hit)
            if block_ids is None:
                if self._preempt_for(request, plan):
                    continue
                break
            self._waiting.pop()
            self._admit(request, hit, num_new, block_ids, plan)

    def _admit(
        self, request: Request, hit: PrefixHit, num_new: int, block_ids: tuple[int, ...], plan: _StepPlan
    ) -> None:
        if request.times.first_scheduled is None:
            request.times.first_scheduled = time.time()
            request.num_cached_tokens = hit.num_tokens
        request.num_computed_tokens = hit.num_tokens
        request.status = RequestStatus.RUNNING
        self._running[request.request_id] = request
        self._run_order = None
        if self._keeps_tables:
            self._tables[request.request_id] = block_ids
        plan.add(request.request_id, num_new, block_ids)

    def _preempt_for(self, request: Request, plan: _StepPlan) -> bool:
        """Preempt the worst running request if its priority is strictly worse than `request`'s."""
        if not self._running:
            return False
        victim = self._worst_running()
        if victim.priority <= request.priority:
            return False
        self._preempt(victim, plan)
        return True

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Recompute-style preemption: free the blocks, keep the outputs, requeue in the original place."""
        request_id = request.request_id
        del self._running[request_id]
        self._run_order = None
        self.kv.free(request_id)
        self._tables.pop(request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.push(request, self._seq[request_id], self._num_tokens(request))
        plan.unschedule(request_id)
        plan.preempted.append(request_id)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        """How far the request can advance this step: its remaining tokens, capped by the budget
        (chunked prefill) and by max_model_len. 0 when it cannot advance."""
        remaining = min(self._num_tokens(request), self.max_model_len) - num_computed
        if remaining <= budget:
            return max(remaining, 0)
        return budget if self.config.enable_chunked_prefill else 0

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        scheduled = []
        requests, block_ids, spec_token_ids = self._requests, plan.block_ids, plan.spec_token_ids
        token_ids, num_tokens = self._token_ids, self._num_tokens
        for request_id, num_new in plan.num_new_tokens.items():
            request = requests[request_id]
            start = request.num_computed_tokens
            end = start + num_new
            scheduled.append(  # positional: request_id, token_ids, start_position, block_ids, sample, spec
                ScheduledRequest(
                    request_id,
                    token_ids(request, start, end),
                    start,
                    block_ids[request_id],
                    end == num_tokens(request),
                    spec_token_ids[request_id],
                )
            )
        finished, self._finished_since_schedule = self._finished_since_schedule, []
        return SchedulerOutput(
            scheduled=tuple(scheduled),
            num_batched_tokens=self.config.max_num_batched_tokens - plan.token_budget,
            preempted_request_ids=tuple(plan.preempted),
            finished_request_ids=tuple(finished),
        )

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request_id = request.request_id
        if self._running.pop(request_id, None) is None:
            self._waiting.remove(request)
        else:
            self._run_order = None
        self.kv.free(request_id)
        self._tables.pop(request_id, None)
        request.status = status
        request.times.finished = time.time()
        del self._requests[request_id]
        del self._seq[request_id]
        self._finished_since_schedule.append(request_id)

    def _worst_running(self) -> Request:
        """The running request preempted first: the last in run order."""
        return max(self._running.values(), key=self._order_key)

    def _order_key(self, request: Request) -> tuple[int, float, int]:
        """Run order: lower priority value first, then earlier arrival, then insertion."""
        return (request.priority, request.arrival_time, self._seq[request.request_id])

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and output) one request can hold, as `_check_fits` judges: the
        context, or fewer where the KV cache (counted as a window reaches it) or, with chunked prefill
        off, the step budget holds fewer."""
        budget = self.config.max_num_batched_tokens
        limit = self.max_model_len
        if self.kv.num_blocks_needed(limit, budget) > self.num_blocks:
            limit = self.num_blocks * self.kv.block_size
        if not self.config.enable_chunked_prefill:
            limit = min(limit, budget)
        return limit

    def _check_fits(self, request: Request) -> None:
        """Reject what could never run, so the scheduler cannot livelock on it. The prompt is named where
        it leaves no room for one generated token (in the KV cache, or in the step budget with chunked
        prefill off), before max_tokens is: a smaller max_tokens must be able to fit where it is named (the
        caller may not have set it: SMG's unset max_tokens is the rest of the context)."""
        if request.num_prompt_tokens > self.max_model_len:
            raise ContextLengthError(
                "prompt", f"{request.num_prompt_tokens} tokens exceed max_model_len {self.max_model_len}"
            )
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        with_one = min(request.num_tokens + 1, self.max_model_len)
        max_tokens_with_kv = min(request.num_tokens + request.sampling_params.max_tokens, self.max_model_len)
        if (num_blocks_needed := self.kv.num_blocks_needed(with_one, budget)) > self.num_blocks:
            raise ContextLengthError(
                "prompt",
                f"its {request.num_tokens} tokens and one generated need {num_blocks_needed} KV blocks but "
                f"the cache has {self.num_blocks}",
            )
        # A preempted request recomputes its prompt and outputs in one step: both must fit.
        if not chunked and with_one > budget:
            if request.num_prompt_tokens > budget:
                raise ContextLengthError(
                    "prompt",
                    f"{request.num_prompt_tokens} tokens exceed max_num_batched_tokens {budget} with chunked "
                    "prefill off",
                )
            raise ContextLengthError(
                "prompt",
                f"{request.num_prompt_tokens} tokens leave no room for an output token in "
                f"max_num_batched_tokens {budget} with chunked prefill off",
            )
        if (num_blocks_needed := self.kv.num_blocks_needed(max_tokens_with_kv, budget)) > self.num_blocks:
            raise ContextLengthError(
                "max_tokens", f"needs {num_blocks_needed} KV blocks but the cache has {self.num_blocks}"
            )
        if not chunked and max_tokens_with_kv > budget:
            raise ContextLengthError(
                "max_tokens",
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({max_tokens_with_kv - request.num_tokens}) exceed max_num_batched_tokens {budget} with "
                "chunked prefill off",
            )
