"""What the engine hands back to callers, one `RequestOutput` per step per request.

`RequestOutput`, `Usage`, `Timings` and `EngineStats` are frozen msgspec structs, not frozen dataclasses:
the frontend builds one of the first three per request per step, the core one `EngineStats` per step, and a
frozen dataclass's `__init__` sets each field through `object.__setattr__` (about 2.7 us for the three,
against 0.3 us as structs; docs/BENCHMARKS.md). `EngineStats` crosses to the frontend in every
`CoreOutputs` message, as an array (no field names: 97 bytes for a one-request step's message instead of
408). Copy one with changes with `msgspec.structs.replace`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import msgspec

from sluice.engine.errors import ContextLengthError, InvalidRequestError


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class Logprobs:
    """Log-probability of the sampled token and of the `top` most likely tokens (raw model logits)."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


class LogprobColumns(msgspec.Struct, frozen=True, array_like=True):
    """The logprobs of a run of tokens, as columns; read it as a sequence of `Logprobs`.

        entry i = Logprobs(TokenLogprob(token_ids[i], logprobs[i]), top)
        top     = the TokenLogprobs of top_token_ids / top_logprobs [i * num_top : (i + 1) * num_top]

    Columns, not an object per value, because they cross from the engine core to the frontend, whose one
    event loop serves every stream: msgpack decodes lists of numbers many times faster than objects.
    """

    token_ids: list[int]
    logprobs: list[float]
    num_top: int = 0
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @overload
    def __getitem__(self, index: int) -> Logprobs: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Logprobs, ...]: ...

    def __getitem__(self, index: int | slice) -> Logprobs | tuple[Logprobs, ...]:
        if isinstance(index, slice):  # as a tuple of Logprobs is sliced (what these columns replaced)
            return tuple(self[position] for position in range(len(self.token_ids))[index])
        position = range(len(self.token_ids))[index]  # IndexError past the end; negative from the end
        start, end = position * self.num_top, (position + 1) * self.num_top
        top = zip(self.top_token_ids[start:end], self.top_logprobs[start:end], strict=True)
        return Logprobs(
            TokenLogprob(self.token_ids[position], self.logprobs[position]),
            tuple(TokenLogprob(token_id, logprob) for token_id, logprob in top),
        )

    def __iter__(self) -> Iterator[Logprobs]:
        return (self[position] for position in range(len(self.token_ids)))


class PromptLogprobs(LogprobColumns):
    """The logprobs of a prompt's tokens after the first. They cross in one message: a 5,800-token prompt
    at 20 top is 122,000 `TokenLogprob`s, which as objects cost the frontend's event loop about 0.3 s to
    decode; as lists of numbers, a few milliseconds."""


class OutputLogprobs(LogprobColumns):
    """The logprobs of a request's sampled tokens: one step's (several when the step accepted draft
    tokens), or several steps' `joined`. `num_top` is the request's `SamplingParams.logprobs`, the same
    in every part of one request. As objects (a `Logprobs` and 21 `TokenLogprob`s a token), a batch-64
    step at 20 top took the core ~1.8 ms to build and the frontend ~0.8 ms to decode; as columns, 0.25
    and 0.14 ms (docs/BENCHMARKS.md)."""

    @classmethod
    def joined(cls, parts: Sequence[OutputLogprobs]) -> OutputLogprobs:
        """The entries of `parts` in order, as one; the part itself when only one has entries."""
        filled = [part for part in parts if part.token_ids]
        if len(filled) <= 1:
            return filled[0] if filled else NO_OUTPUT_LOGPROBS
        token_ids, logprobs, top_token_ids, top_logprobs = [], [], [], []
        for part in filled:
            token_ids += part.token_ids
            logprobs += part.logprobs
            top_token_ids += part.top_token_ids
            top_logprobs += part.top_logprobs
        return cls(token_ids, logprobs, filled[0].num_top, top_token_ids, top_logprobs)

    def first(self, num_entries: int) -> OutputLogprobs:
        """The first `num_entries` entries (a stop string ended the request inside a step's tokens)."""
        num_top_values = num_entries * self.num_top
        return OutputLogprobs(
            self.token_ids[:num_entries],
            self.logprobs[:num_entries],
            self.num_top,
            self.top_token_ids[:num_top_values],
            self.top_logprobs[:num_top_values],
        )


NO_PROMPT_LOGPROBS = PromptLogprobs([], [])
NO_OUTPUT_LOGPROBS = OutputLogprobs([], [])


class Usage(msgspec.Struct, frozen=True):
    """`prompt_tokens_computed`: prompt tokens this request ran through the model (after prefix-cache
    hits; 0 for samples 1.. of an n-sample request, which share sample 0's prompt)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_tokens_computed: int = 0
    # Speculative decoding: draft tokens verified for this request, and those accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


class Timings(msgspec.Struct, frozen=True):
    """Wall-clock timestamps (time.time()); None until the event happened."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None

    @property
    def queue_seconds(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft_seconds(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def total_seconds(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made; `arguments` is a JSON object as text, `id` names the call (the
    tool message with its result gives it as `tool_call_id`)."""

    name: str
    arguments: str
    id: str


class RequestOutput(msgspec.Struct, frozen=True):
    """A delta: the tokens and text produced since the previous output for this request.

    `finish_reason` is set on the last output only: "stop", "length", "abort" or "error".
    A request with n > 1 yields the outputs of its n samples interleaved, each with its `index`; each
    sample finishes on its own. `prompt_logprobs` (one per prompt token after the first) come once, on
    sample 0's first output, when asked for.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: OutputLogprobs = NO_OUTPUT_LOGPROBS
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    num_preemptions: int = 0
    # Set when the request was refused before it ran (finish_reason "error"): the field to blame, and
    # whether the request does not fit the model's context or the KV cache (`refusal`).
    invalid_field: str | None = None
    too_long: bool = False
    # On the last output of a chat request with tools: the calls parsed from the whole output and, when
    # there are some, the output's text outside them (the assistant message's content beside them).
    tool_calls: tuple[ToolCall, ...] = ()
    content: str = ""
    index: int = 0
    prompt_logprobs: PromptLogprobs = NO_PROMPT_LOGPROBS
    # A chat request's reasoning delta when the engine runs a reasoning parser (`text` is then the content
    # delta: the output after the think block).
    reasoning: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def refusal(self) -> InvalidRequestError:
        """What a refused request's output (`invalid_field` set) raises: a ContextLengthError when it does
        not fit, else an InvalidRequestError naming the field."""
        error_type = ContextLengthError if self.too_long else InvalidRequestError
        return error_type(self.invalid_field, self.error.partition(": ")[2])


class EngineStats(msgspec.Struct, frozen=True, array_like=True):
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_preemptions: int
    num_prompt_tokens_computed: int
    num_generation_tokens: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    # Lookups of requests resumed after preemption, not in prefix_cache_queries / _hits (vLLM's
    # PrefixCacheStats.preempted_*): they find their own blocks, which would inflate the hit rate.
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    num_steps: int = 0
    num_waiting_tokens: int = 0  # tokens the waiting requests have yet to compute (Scheduler's)
    # Of num_waiting, the requests whose grammar is compiling: not held back for a seat (admission
    # control's test, AsyncEngine._num_queued), each takes a free one once its grammar is ready.
    num_waiting_for_grammar: int = 0
    # Speculative decoding: drafts verified and accepted; per draft position j (0-based), how many
    # drafts were verified there and how many accepted (acceptance rate at j = accepted / verified).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    draft_tokens_per_position: tuple[int, ...] = ()
    accepted_draft_tokens_per_position: tuple[int, ...] = ()
    extra: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / max(self.num_kv_blocks_total, 1)
