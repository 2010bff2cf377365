"""The engine core: scheduler, model runner and sampler. Token ids in, token ids out; no text.

It runs in its own process behind a server (`sluice.engine.process.core_process`) and in-process under the
offline `LLM` (`sluice.engine.frontend.engine.Engine`); both drive this same class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from functools import partial

import torch

from sluice.engine.config import EngineConfig
from sluice.engine.core.grammar_waiting_room import GrammarWaitingRoom
from sluice.engine.core.launched_step import (
    LaunchedStep,
    SamplingFailure,
    StepResults,
    launch_sampling,
    needs_step_tokens,
    with_tokens_in_flight,
)
from sluice.engine.core.prompt_logprobs_tracker import PromptLogprobsTracker
from sluice.engine.core.step_profiler import StepProfiler
from sluice.engine.errors import InvalidRequestError
from sluice.engine.executor.build import build_model_runner
from sluice.engine.faults import FaultInjector
from sluice.engine.kv_cache.kv_events import KVEvent, KVEventRecorder
from sluice.engine.loading.model_loader import ModelSource, load_model_source
from sluice.engine.messages import AddRequest, CoreOutput, StartProfile
from sluice.engine.model_info import ModelInfo
from sluice.engine.outputs import EngineStats, OutputLogprobs
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sample.grammar_mask import GrammarMask
from sluice.engine.sample.logits_processors import counts_outputs, default_processors
from sluice.engine.sample.sampler import SampledToken, Sampler, SamplingRow
from sluice.engine.scheduler.async_scheduler import AsyncScheduler
from sluice.engine.scheduler.scheduler import Scheduler
from sluice.engine.scheduler.scheduler_output import SchedulerOutput
from sluice.engine.spec_decode.build import build_proposer
from sluice.engine.spec_decode.proposer import Proposal
from sluice.engine.spec_decode.rejection_sampler import RejectionSampler
from sluice.engine.spec_decode.speculator import Speculator
from sluice.engine.structured.grammar_compiler import GrammarCompiler
from sluice.engine.worker.input_batch import SampledTokenIds

logger = logging.getLogger(__name__)

# How long an idle step waits for a compiling grammar before returning (seconds).
GRAMMAR_IDLE_WAIT_SECONDS = 0.01


class EngineCore:
    """Not thread-safe: one thread owns it. `step()` advances every scheduled request by one step.

    One request per `AddRequest` (n > 1 is the frontend's: `sluice.engine.frontend.parallel_sampling`).
    Side concerns sit behind one object each, called at fixed points: the grammar waiting room
    (`GrammarWaitingRoom`: on add, before scheduling, when idle), prompt logprobs
    (`PromptLogprobsTracker`: around the model run, in each output), speculation (`Speculator`: drafts
    verified at sampling, proposed after the update) and fault injection (`FaultInjector`, tests only:
    before the model runs and before sampling).

    With async scheduling (`EngineConfig.schedules_async`: by default on one CUDA device) a step schedules
    and launches the next step before finishing the one in flight (`_step_overlapped`;
    `sluice.engine.core.launched_step`).
    """

    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        source = source if source is not None else load_model_source(config.model)
        self.tokenizer = source.tokenizer
        self.model_runner = build_model_runner(config, source)  # tensor-parallel: an executor over the ranks
        # as the runner completed it for its device: the step budget (`with_step_budget`)
        self.config = config = self.model_runner.config
        single_rank = config.parallel.tensor_parallel_size == 1  # the ranks' executor has no one device
        self.async_scheduling = config.schedules_async(self.model_runner.device.type if single_rank else None)
        self.scheduler = (AsyncScheduler if self.async_scheduling else Scheduler)(
            config.scheduler,
            config.cache,
            self.model_runner.num_blocks,
            self.model_runner.max_model_len,
            sliding_window=source.arch.uniform_sliding_window,
        )
        grammar_mask = GrammarMask()
        self.sampler = Sampler(processors=[*default_processors(), grammar_mask])
        self.rejection_sampler = RejectionSampler(self.sampler)
        # A draft model runs on rank 0, whose runner loaded it and sized both KV caches together.
        rank_zero = self.model_runner if single_rank else self.model_runner.runner
        spec = config.speculative
        self.speculator = Speculator(
            build_proposer(config, rank_zero.draft_runner),
            None if spec is None else spec.disable_by_batch_size,
            constrain=grammar_mask.constrained_drafts,
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
        )
        self.faults = FaultInjector.from_env()
        # StartProfile / StopProfile: the core's own process (with tensor parallelism, not the ranks')
        self.profiler = StepProfiler(self.model_runner.device if single_rank else torch.device("cpu"))
        eos = set(source.arch.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.grammars = (
            None
            if self.tokenizer is None
            else GrammarCompiler(self.tokenizer, source.arch.vocab_size, self.eos_token_ids)
        )
        self._grammar_room = GrammarWaitingRoom(self.grammars)
        self._prompt_logprobs = PromptLogprobsTracker()
        self._sampling_rows: dict[str, SamplingRow] = {}  # request id -> its row, until it finishes
        self._in_flight: LaunchedStep | None = None  # async scheduling: the step running on the device
        self._maybe_synchronous: set[str] = set()  # ids of requests that need their steps' tokens first
        self._counts_outputs: set[str] = set()  # ids of requests whose sampling counts their outputs
        self._constrained: set[str] = set()  # ids of requests with a grammar
        self.model_info = ModelInfo(
            name=config.model.served_model_name or source.name,
            architecture=source.arch.architecture,
            max_model_len=self.model_runner.max_model_len,
            vocab_size=source.arch.vocab_size,
            eos_token_ids=tuple(sorted(self.eos_token_ids)),
            block_size=config.cache.block_size,
            num_kv_blocks=self.model_runner.num_blocks,
            speculative_method=spec.method if spec is not None else "",
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_request_tokens=self.scheduler.max_request_tokens,
        )
        self._num_steps = 0
        self._num_prompt_tokens_computed = 0
        self._num_generation_tokens = 0

    def step(self) -> list[CoreOutput]:
        """Schedule, run the model, sample, update: one output per request that got tokens or failed."""
        if self.async_scheduling:
            return self._step_overlapped()  # the same, with the update of the step before this one
        refused = self._admit_ready()
        scheduler_output = self.scheduler.schedule()
        self._free(scheduler_output.finished_request_ids)
        if scheduler_output.is_empty:
            return refused + self._idle()
        logits = self._execute(scheduler_output)
        sampled, sampling_errors = self._sample(logits, scheduler_output)
        return refused + self._update(scheduler_output, sampled, sampling_errors)

    def start_profile(self, start: StartProfile) -> None:
        self.profiler.start(start)

    def stop_profile(self) -> None:
        self.profiler.stop()

    def _step_overlapped(self) -> list[CoreOutput]:
        """Async scheduling: schedules and launches step N+1 while step N (in flight) runs on the device,
        then finishes N, whose tokens were copied back meanwhile: returns N's outputs."""
        refused = self._admit_ready()
        if self._in_flight_needs_its_tokens():
            refused += self._finish_in_flight()  # this step runs after it: synchronously
        scheduler_output = self.scheduler.schedule()
        self._free(scheduler_output.finished_request_ids)
        launched = None if scheduler_output.is_empty else self._launch(scheduler_output)
        # No drafts from N's tokens: N+1 is scheduled already (with a placeholder where they would go).
        outputs = self._finish_in_flight(propose=False)
        self._in_flight = launched
        if launched is None and not outputs:
            return refused + self._idle()
        return refused + outputs

    def add_request(self, add: AddRequest) -> None:
        """Queues one validated request (the frontend checked the prompt against `model_info`).

        A request with a constraint waits outside the scheduler until its grammar compiled (in the
        compile thread); if it does not compile, a later step ends it with an error naming the field.
        """
        if add.params.n != 1:
            raise InvalidRequestError(
                "n", "the engine core runs one sample per request (the frontend fans out)"
            )
        if self.scheduler.get_request(add.request_id) is not None or add.request_id in self._grammar_room:
            raise InvalidRequestError("request_id", f"{add.request_id!r} is already in use")
        request = Request(
            request_id=add.request_id,
            prompt_token_ids=list(add.prompt_token_ids),
            sampling_params=add.params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=add.arrival_time,
            priority=add.priority,
            cache_salt=add.cache_salt,
            use_speculation=add.use_speculation,
        )
        if add.params.constraint is None:
            self.scheduler.add_request(request)
        else:
            self._grammar_room.add(request)

    def discard_in_flight(self) -> None:
        """After `step()` raised with every request then aborted (the offline `LLM` does): forgets the
        step in flight and, with async scheduling, the steps scheduled and never updated, so the next
        `step()` schedules afresh. A synchronous engine keeps nothing between steps."""
        self._in_flight = None
        if self.async_scheduling:
            self.scheduler.discard_steps_in_flight()

    def abort(
        self,
        request_ids: Iterable[str],
        errors: Mapping[str, str] | None = None,
        invalid_fields: Mapping[str, str] | None = None,
    ) -> list[CoreOutput]:
        """Frees the requests' blocks now; their final outputs say "abort", or "error" with the message
        in `errors` (and the request field to blame in `invalid_fields`, if any). Unknown or finished ids
        are skipped."""
        errors = errors or {}
        invalid_fields = invalid_fields or {}
        outputs = []
        for request_id in request_ids:
            error = errors.get(request_id)
            status = RequestStatus.FINISHED_ABORTED if error is None else RequestStatus.FINISHED_ERROR
            request = self.scheduler.finish_request(request_id, status) or self._grammar_room.abort(
                request_id, status
            )
            if request is not None:
                outputs.append(self._output(request, None, error, invalid_fields.get(request_id)))
        self.speculator.free([o.request_id for o in outputs])  # the draft's KV blocks, now
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a worker failure for `step()` to raise."""
        work = self.scheduler.has_unfinished_requests() or len(self._grammar_room) > 0
        return work or self.model_runner.failed

    def has_work(self) -> bool:
        """Whether `step()` has anything to do: unfinished requests, finished ones whose sampling,
        penalty and proposer state the next step frees, or a step in flight whose requests all finished
        (its results are discarded). A loop that steps while this holds keeps nothing of a request once
        it stops (vLLM's busy loop steps while `has_requests()`, finished ones included)."""
        pending = self.scheduler.has_finished_requests() or self._in_flight is not None
        return pending or self.has_unfinished_requests()

    def record_kv_events(self) -> None:
        """From now on the prefix cache's changes are recorded, for `take_kv_events` after each step."""
        self.scheduler.kv.record_events(KVEventRecorder(self.config.cache.block_size))

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's changes since the last call, in order (none unless `record_kv_events`)."""
        return self.scheduler.kv.take_events()

    def stats(self) -> EngineStats:
        """The scheduler's counts; a request whose grammar is compiling waits (vLLM's WAITING_FOR_FSM)."""
        s, room = self.scheduler, self._grammar_room
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting + len(room),
            num_kv_blocks_total=s.num_blocks_total,
            num_kv_blocks_used=s.num_blocks_used,
            num_preemptions=s.num_preemptions,
            num_prompt_tokens_computed=self._num_prompt_tokens_computed,
            num_generation_tokens=self._num_generation_tokens,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            prefix_cache_evictions=s.prefix_cache_evictions,
            prefix_cache_preempted_queries=s.prefix_cache_preempted_queries,
            prefix_cache_preempted_hits=s.prefix_cache_preempted_hits,
            num_steps=self._num_steps,
            num_waiting_tokens=s.num_waiting_tokens + room.num_tokens,
            num_waiting_for_grammar=len(room),
            **self.speculator.counters.stats_fields(),
        )

    def _admit_ready(self) -> list[CoreOutput]:
        """Checks the workers (one that is gone fails the engine here) and admits the requests whose
        grammar compiled; returns those refused."""
        self.model_runner.check_health()
        return self._grammar_room.admit_ready(self.scheduler.add_request)

    def _idle(self) -> list[CoreOutput]:
        """Nothing to run: wait a little for a compiling grammar rather than spin."""
        self._grammar_room.wait(GRAMMAR_IDLE_WAIT_SECONDS)
        return []

    def _free(self, request_ids: Iterable[str]) -> None:
        """Drop the sampler's, the prompt logprobs' and the proposer's state of finished requests."""
        request_ids = list(request_ids)
        if not request_ids:
            return
        for request_id in request_ids:
            self._sampling_rows.pop(request_id, None)
            self._maybe_synchronous.discard(request_id)
            self._counts_outputs.discard(request_id)
            self._constrained.discard(request_id)
        self.sampler.free(request_ids)
        self._prompt_logprobs.free(request_ids)
        self.speculator.free(request_ids)

    def _execute(
        self, scheduler_output: SchedulerOutput, sampled_before: SampledTokenIds | None = None
    ) -> torch.Tensor:
        """Logits of the sampled rows; prompt logprobs computed on the way are kept for `_output`.
        `sampled_before`: the step in flight's tokens, for this step's placeholders (async scheduling)."""
        self._inject_faults("step", (s.request_id for s in scheduler_output.scheduled))
        self._count_scheduled(scheduler_output)
        self.profiler.forward_launched(scheduler_output.num_batched_tokens)
        # The executor of tensor-parallel ranks takes no sampled_before: async scheduling needs one rank.
        before = () if sampled_before is None else (sampled_before,)
        slices = self._prompt_logprobs.slices(scheduler_output, self.scheduler.get_request)
        if not slices:
            return self.model_runner.execute_model(scheduler_output, *before)
        logits, results = self.model_runner.execute_model_with_prompt_logprobs(
            scheduler_output, slices, *before
        )
        self._prompt_logprobs.add(slices, results)
        return logits

    def _launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Async scheduling: runs the model and queues the sampling, waiting for neither; a step that
        verifies drafts is sampled on the host when the next step finishes it (`LaunchedStep.verifying`)."""
        in_flight = self._in_flight
        logits = self._execute(scheduler_output, None if in_flight is None else in_flight.sampled_token_ids())
        requests = [self.scheduler.get_request(s.request_id) for s in scheduler_output.scheduled if s.sample]
        if any(s.spec_token_ids for s in scheduler_output.scheduled):
            sample = self._sampling(logits, scheduler_output)
            launched = LaunchedStep.verifying(scheduler_output, requests, sample)
        else:
            rows = [self._sampling_row(request) for request in requests]
            if in_flight is not None and (self._counts_outputs or self._constrained):
                rows = with_tokens_in_flight(
                    rows, scheduler_output, in_flight, self._counts_outputs, self._constrained
                )
            launched = launch_sampling(
                self.sampler, logits, scheduler_output, requests, rows, self._inject_faults
            )
        launched.num_finished = self.scheduler.num_finished
        return launched

    def _in_flight_needs_its_tokens(self) -> bool:
        """A request of the step in flight that is still live needs its tokens before its next step (it
        may speculate, and the batch is below the speculative config's disable_by_batch_size), or the step
        is sampled on the host (it verifies drafts): it has no device tokens to fill the next step's
        placeholders."""
        if self._in_flight is None:
            return False
        if self._in_flight.token_ids is None:
            return True
        if not self._maybe_synchronous or not self.speculator.drafts_at(self.scheduler.num_running):
            return False
        candidates = (r for r in self._in_flight.requests if r.request_id in self._maybe_synchronous)
        return any(self.scheduler.get_request(r.request_id) is r for r in candidates)

    def _finish_in_flight(self, propose: bool = True) -> list[CoreOutput]:
        """Waits for the step in flight's tokens and updates with them; [] when none is in flight.
        `propose`: drafts are proposed from the tokens (no step has been scheduled since it)."""
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            return []
        # Requests that finished after the launch (at the update before, or aborted) get nothing.
        all_live = launched.num_finished == self.scheduler.num_finished
        is_live = None if all_live else lambda r: self.scheduler.get_request(r.request_id) is r
        sampled, sampling_errors = launched.results(is_live)
        return self._update(launched.scheduler_output, sampled, sampling_errors, propose)

    def _sample(
        self, logits: torch.Tensor, scheduler_output: SchedulerOutput
    ) -> tuple[dict[str, list[SampledToken]], dict[str, SamplingFailure]]:
        """Per slice that reached its request's last token, in scheduled order: its accepted drafts
        (if it verified any) then one token.

        A batch that fails is sampled again request by request, so a failure caused by one request's
        parameters ends that request (returned in the second dict: request id -> error) and the others
        go on.
        """
        return self._sampling(logits, scheduler_output)()

    def _sampling(self, logits: torch.Tensor, scheduler_output: SchedulerOutput) -> Callable[[], StepResults]:
        """`_sample`'s work, done when the result is called; the step's rows and drafts are taken now (a
        request aborted in between is still sampled, and its result discarded)."""
        scheduled = [s for s in scheduler_output.scheduled if s.sample]
        rows = [self._sampling_row(self.scheduler.get_request(s.request_id)) for s in scheduled]
        proposals = [self.speculator.proposal(s.request_id, s.spec_token_ids) for s in scheduled]
        return partial(self._sample_rows, logits, rows, proposals)

    def _sample_rows(
        self, logits: torch.Tensor, rows: list[SamplingRow], proposals: list[Proposal | None]
    ) -> StepResults:
        try:
            self._inject_faults("sample", (row.request_id for row in rows))
            sampled = self.rejection_sampler.sample(logits, rows, proposals)
            return {row.request_id: s for row, s in zip(rows, sampled, strict=True)}, {}
        except Exception as exc:
            if not isinstance(exc, InvalidRequestError):  # not a request's own parameters (NoTokenLeftError)
                logger.exception("batched sampling failed; sampling each request alone")
        good, failed = {}, {}
        start = 0
        for row, proposal in zip(rows, proposals, strict=True):
            end = start + 1 + (0 if proposal is None else len(proposal.token_ids))
            try:
                self._inject_faults("sample", [row.request_id])
                good[row.request_id] = self.rejection_sampler.sample(logits[start:end], [row], [proposal])[0]
            except Exception as exc:
                failed[row.request_id] = SamplingFailure.of(exc)
            start = end
        return good, failed

    def _update(
        self,
        scheduler_output: SchedulerOutput,
        sampled: dict[str, list[SampledToken]],
        sampling_errors: dict[str, SamplingFailure],
        propose: bool = True,
    ) -> list[CoreOutput]:
        """Counts the step, ends the requests whose sampling failed, hands the sampled tokens to the
        scheduler and proposes the next drafts (with `propose`, while the batch is below the speculative
        config's disable_by_batch_size): one output per request touched."""
        self._count_sampled(scheduler_output, sampled)
        self.profiler.step_ended()  # a profile of N forwards ends with the step that updates the N-th
        # Before the update, which skips them.
        failed = []
        if sampling_errors:
            messages = {r: failure.message for r, failure in sampling_errors.items()}
            fields = {r: f.invalid_field for r, f in sampling_errors.items() if f.invalid_field is not None}
            failed = self.abort(list(sampling_errors), messages, fields)
        updated = self._append(scheduler_output, sampled)
        # The tokens kept: a stop within a verified run drops the rest, as does an abort mid-step. A stop
        # string is the frontend's to find: the tokens of such a run after it count (the model made them),
        # though the output leaves them out.
        self._num_generation_tokens += sum(len(tokens) for _, tokens in updated)
        draft = propose and self.speculator.drafts_at(self.scheduler.num_running)
        self.speculator.propose((r for r, _ in updated), self.scheduler.get_request, draft)
        return failed + [self._output(r, tokens) for r, tokens in updated]

    def _append(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, list[SampledToken]]
    ) -> list[tuple[Request, list[SampledToken]]]:
        """The scheduler takes the sampled tokens; returns each request that got tokens with those it
        kept (a token stop in the middle of a run drops the rest)."""
        num_before = {}  # of the requests that got several tokens: a stop may cut the run
        token_ids = {}
        for request_id, tokens in sampled.items():
            token_ids[request_id] = [t.token_id for t in tokens]
            request = self.scheduler.get_request(request_id) if len(tokens) > 1 else None
            if request is not None:
                num_before[request_id] = request.num_output_tokens
        kept = []
        for request in self.scheduler.update_from_output(scheduler_output, token_ids):
            tokens, before = sampled[request.request_id], num_before.get(request.request_id)
            kept.append((request, tokens if before is None else tokens[: request.num_output_tokens - before]))
        return kept

    def _inject_faults(self, place: str, request_ids: Iterable[str]) -> None:
        """`SLUICE_INJECT_FAULT` (tests of failure handling): raises at `place` for marked requests."""
        if self.faults is not None:
            self.faults.check(place, request_ids)

    def _sampling_row(self, request: Request) -> SamplingRow:
        """The request's row, made once: it holds the request's own token lists, which only grow in
        place (and its grammar, set before the request reached the scheduler)."""
        row = self._sampling_rows.get(request.request_id)
        if row is None:
            row = SamplingRow(
                request_id=request.request_id,
                params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                eos_token_ids=request.eos_token_ids,
                grammar=request.grammar,
            )
            self._sampling_rows[request.request_id] = row
            if needs_step_tokens(request, self.speculator.proposer is not None):
                self._maybe_synchronous.add(request.request_id)
            if counts_outputs(request.sampling_params):
                self._counts_outputs.add(request.request_id)
            if request.grammar is not None:
                self._constrained.add(request.request_id)
        return row

    def _output(
        self,
        request: Request,
        sampled: list[SampledToken] | None,
        error: str | None = None,
        invalid_field: str | None = None,
    ) -> CoreOutput:
        finished = request.is_finished
        times = request.times
        sampled = sampled or []
        prompt_logprobs = self._prompt_logprobs.take(request) if sampled else None
        # One entry per sampled token: a step that accepted drafts has several, joined into one struct.
        logprobs = [s.logprobs for s in sampled if s.logprobs is not None]
        return CoreOutput(
            request_id=request.request_id,
            new_token_ids=[s.token_id for s in sampled],
            new_logprobs=OutputLogprobs.joined(logprobs) if logprobs else None,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            first_scheduled=times.first_scheduled,
            first_token=times.first_token,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason if finished else None,
            error=error,
            finished_time=times.finished if finished else None,
            invalid_field=invalid_field,
            prompt_logprobs=prompt_logprobs,
            num_prompt_tokens_computed=request.num_prompt_tokens_computed,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_draft_tokens=request.num_accepted_draft_tokens,
        )

    def _count_sampled(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, list[SampledToken]]
    ) -> None:
        """Steps, drafts verified and accepted (vLLM's figures: past a stop too)."""
        self._num_steps += 1
        self.speculator.count(scheduler_output, {r: len(tokens) for r, tokens in sampled.items()})

    def _count_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """Prompt tokens computed (prefill work, after prefix-cache hits)."""
        for scheduled in scheduler_output.scheduled:
            request = self.scheduler.get_request(scheduled.request_id)
            if scheduled.start_position >= request.num_prompt_tokens:
                continue  # past the prompt (a decode): no prompt token
            prompt_end = min(scheduled.seq_len, request.num_prompt_tokens)
            num_prompt = max(0, prompt_end - scheduled.start_position)
            request.num_prompt_tokens_computed += num_prompt
            self._num_prompt_tokens_computed += num_prompt
