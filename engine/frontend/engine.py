"""The in-process engine of the offline `LLM`: an `EngineCore` and the frontend's output processing,
driven by the caller's thread (a server runs the same core in its own process: `AsyncEngine`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from sluice.engine.config import EngineConfig
from sluice.engine.core.engine_core import EngineCore
from sluice.engine.frontend.output_processor import OutputProcessor
from sluice.engine.loading.model_loader import ModelSource
from sluice.engine.messages import AddRequest, CoreOutput, checked_cache_salt, checked_priority
from sluice.engine.outputs import EngineStats, RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.tool_calls import ToolUse
from sluice.engine.text.prompt import check_prompt, truncated_prompt


class Engine:
    """Not thread-safe: one thread owns an Engine."""

    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        self.core = EngineCore(config, source)
        self.tokenizer = self.core.tokenizer
        self.model_info = self.core.model_info
        self.eos_token_ids = self.core.eos_token_ids
        self.output_processor = OutputProcessor(
            self.tokenizer,
            self.core.faults,
            reasoning_parser=config.model.reasoning_parser,
            eos_token_ids=self.model_info.eos_token_ids,
        )

    @property
    def model_runner(self):
        return self.core.model_runner

    def step(self) -> list[RequestOutput]:
        """Advances every scheduled request by one step; returns the outputs it produced."""
        processed = self.output_processor.process(self.core.step())
        self.core.abort(processed.to_abort)
        for add in processed.to_add:  # samples 1 .. n - 1 of requests whose sample 0 answered
            self.core.add_request(add)
        return processed.outputs

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        tool_use: ToolUse | None = None,
        use_speculation: bool = True,
        chat: bool = False,
    ) -> list[int]:
        """Validates and queues a request; returns its prompt as queued (`truncate_prompt_tokens` applied);
        raises InvalidRequestError / ContextLengthError. With `tool_use`, `params` must already carry its
        constraint (`ToolUse.sampling_params`). `chat`: the prompt is a rendered chat (whose outputs a
        reasoning parser splits)."""
        prompt_token_ids = truncated_prompt(prompt_token_ids, params, self.model_info)
        check_prompt(prompt_token_ids, params, self.model_info, has_tokenizer=self.tokenizer is not None)
        priority, cache_salt = checked_priority(priority), checked_cache_salt(cache_salt)
        add = AddRequest(
            request_id, list(prompt_token_ids), params, time.time(), priority, cache_salt, use_speculation
        )
        first = self.output_processor.add_request(add, tool_use, chat=chat)  # sample 0 when n > 1
        try:
            self.core.add_request(first)
        except Exception as exc:  # refused (e.g. needs more KV blocks than the cache has): forget it
            self.output_processor.process([CoreOutput.failed(first.request_id, str(exc))])
            raise
        return add.prompt_token_ids

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Frees the requests' blocks now (every sample of an n-sample request); returns their final
        outputs (finish_reason "abort")."""
        processed = self.output_processor.abort(request_ids)
        return processed.outputs + self.output_processor.process(self.core.abort(processed.to_abort)).outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def has_work(self) -> bool:
        """Unfinished requests, or finished ones whose state a `step()` frees (`EngineCore.has_work`)."""
        return self.core.has_work()

    def stats(self) -> EngineStats:
        return self.core.stats()
