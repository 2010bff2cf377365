"""The synchronous engine core: one `step()` schedules, runs the model, samples and reports."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from engine.config import EngineConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.errors import InvalidRequestError
from engine.frontend.output_processor import OutputProcessor
from engine.loading.model_loader import ModelSource, load_model_source
from engine.model_info import ModelInfo
from engine.outputs import EngineStats, RequestOutput
from engine.sample.sampler import SampledToken, Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.text.prompt import check_prompt
from engine.worker.model_runner import ModelRunner


class Engine:
    """Not thread-safe: one thread owns an Engine (see `AsyncEngine` for the asyncio front)."""

    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        source = source if source is not None else load_model_source(config.model)
        self.config = config
        self.tokenizer = source.tokenizer
        self.model_runner = ModelRunner(config, source)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.model_runner.num_blocks,
            self.model_runner.max_model_len,
            sliding_window=source.arch.uniform_sliding_window,
        )
        self.sampler = Sampler()
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish_request)
        eos = set(source.arch.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.model_info = ModelInfo(
            name=source.name,
            architecture=source.arch.architecture,
            max_model_len=self.model_runner.max_model_len,
            vocab_size=source.arch.vocab_size,
            eos_token_ids=tuple(sorted(self.eos_token_ids)),
            block_size=config.cache.block_size,
            num_kv_blocks=self.model_runner.num_blocks,
        )
        self._num_steps = 0
        self._num_prompt_tokens_computed = 0
        self._num_generation_tokens = 0

    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request by one step; returns the outputs it produced."""
        scheduler_output = self.scheduler.schedule()
        self.sampler.free(scheduler_output.finished_request_ids)
        if scheduler_output.is_empty:
            return []
        logits = self.model_runner.execute_model(scheduler_output)
        sampled = self._sample(logits, scheduler_output)
        self._count(scheduler_output, num_sampled=len(sampled))
        token_ids = {request_id: s.token_id for request_id, s in sampled.items()}
        updated = self.scheduler.update_from_output(scheduler_output, token_ids)
        return self.output_processor.process(updated, {rid: s.logprobs for rid, s in sampled.items()})

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validates and queues a request; raises InvalidRequestError / ContextLengthError."""
        if self.scheduler.get_request(request_id) is not None:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        self.check_prompt(prompt_token_ids, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
        )
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)
        return request

    def check_prompt(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError / ContextLengthError for a prompt this model cannot serve.

        Reads only the model's fixed facts, so any thread may call it.
        """
        check_prompt(
            prompt_token_ids,
            params,
            vocab_size=self.model_info.vocab_size,
            max_model_len=self.model_info.max_model_len,
            has_tokenizer=self.tokenizer is not None,
        )

    def abort(self, request_ids: Iterable[str], error: str | None = None) -> list[RequestOutput]:
        """Frees the requests' blocks now; returns their final outputs (finish_reason "abort", or
        "error" with `error` as the message). Unknown ids are skipped."""
        status = RequestStatus.FINISHED_ABORTED if error is None else RequestStatus.FINISHED_ERROR
        finished = (self.scheduler.finish_request(request_id, status) for request_id in request_ids)
        return [self.output_processor.finish_aborted(r, error) for r in finished if r is not None]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def unfinished_request_ids(self) -> list[str]:
        return self.scheduler.request_ids()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_kv_blocks_total=s.num_blocks_total,
            num_kv_blocks_used=s.num_blocks_used,
            num_preemptions=s.num_preemptions,
            num_prompt_tokens_computed=self._num_prompt_tokens_computed,
            num_generation_tokens=self._num_generation_tokens,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            prefix_cache_evictions=s.prefix_cache_evictions,
            num_steps=self._num_steps,
        )

    def _sample(self, logits: torch.Tensor, scheduler_output: SchedulerOutput) -> dict[str, SampledToken]:
        """Sample one token for each slice that reached its request's last token, in scheduled order."""
        rows = []
        for scheduled in scheduler_output.scheduled:
            if not scheduled.sample:
                continue
            request = self.scheduler.get_request(scheduled.request_id)
            rows.append(
                SamplingRow(
                    request_id=request.request_id,
                    params=request.sampling_params,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    eos_token_ids=request.eos_token_ids,
                )
            )
        sampled = self.sampler.sample(logits, rows)
        return {row.request_id: s for row, s in zip(rows, sampled, strict=True)}

    def _count(self, scheduler_output: SchedulerOutput, num_sampled: int) -> None:
        """Prompt tokens computed (prefill work, after prefix-cache hits) and tokens generated."""
        self._num_steps += 1
        self._num_generation_tokens += num_sampled
        for scheduled in scheduler_output.scheduled:
            request = self.scheduler.get_request(scheduled.request_id)
            prompt_end = min(scheduled.seq_len, request.num_prompt_tokens)
            self._num_prompt_tokens_computed += max(0, prompt_end - scheduled.start_position)
