"""A request as the engine tracks it: token counts, state, and timestamps. No torch here."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class RequestTimes:
    """Wall-clock timestamps (time.time()) of a request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    """Engine-side state of one request.

    Invariants: `num_computed_tokens <= num_tokens`; the tokens in
    `all_token_ids[:num_computed_tokens]` have K/V in the request's blocks. A request produces a new
    token only in a step whose scheduled tokens reach `num_tokens`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens this request ran through the model (not cached)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    grammar: object | None = None  # the compiled constraint (xgrammar CompiledGrammar), set by the core
    # Speculative decoding: the draft tokens proposed for the next step (after the last token, not part
    # of num_tokens), whether this request may speculate at all, and its running counts.
    use_speculation: bool = True
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    times: RequestTimes = field(init=False)
    # The first output index its constraint applies to: 0, or the one after its `after_token_id` (a
    # thinking chat's </think>); None while that token has not come (the first `_searched` outputs lack it)
    # or without a constraint.
    constraint_start: int | None = field(init=False)
    _searched: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        self.times = RequestTimes(arrival=self.arrival_time)
        constraint = self.sampling_params.constraint
        self.constraint_start = 0 if constraint is not None and constraint.after_token_id is None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """`all_token_ids[start:end]` (0 <= start <= end) without concatenating the whole sequence: a step
        reads a few tokens of a context of thousands."""
        prompt, outputs = self.prompt_token_ids, self.output_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            return tuple(prompt[start:end])
        if start >= num_prompt:
            return tuple(outputs[start - num_prompt : end - num_prompt])
        return tuple(prompt[start:]) + tuple(outputs[: end - num_prompt])

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def append_output_tokens(self, token_ids: Sequence[int], max_model_len: int) -> RequestStatus | None:
        """Append a step's accepted tokens one at a time, checking the token stops after each: a stop in
        the middle of the run drops the tokens after it. Returns the finishing status, if any."""
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            status = self.check_token_stop()
            if status is None and self.num_tokens >= max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                return status
        return None

    def _under_constraint(self, index: int) -> bool:
        """Whether output token `index` was sampled under the request's constraint. Each output is searched
        for the constraint's `after_token_id` once."""
        if self.constraint_start is None and self.sampling_params.constraint is not None:
            after, outputs = self.sampling_params.constraint.after_token_id, self.output_token_ids
            try:
                self.constraint_start = outputs.index(after, self._searched) + 1
            except ValueError:
                self._searched = len(outputs)
        return self.constraint_start is not None and index >= self.constraint_start

    def check_token_stop(self) -> RequestStatus | None:
        """Stop conditions decided by token ids alone (stop strings are the detokenizer's job)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        # A constrained output ends where its constraint is complete, whatever ignore_eos and min_tokens
        # say: the grammar mask lets eos through only there, and nothing else after it. Before the
        # constraint applies (a thinking chat's think block), eos is what it is without one.
        if last in self.eos_token_ids and self._under_constraint(len(self.output_token_ids) - 1):
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and last in self.eos_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
