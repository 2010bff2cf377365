"""Turns the core's per-step token outputs into `RequestOutput` deltas: text, stop strings, usage.

Token-level stops (eos, stop token ids, max_tokens) are decided by the core's scheduler; stop strings are
found here, after detokenization, and the request is then aborted in the core (`ProcessedOutputs.to_abort`).
A request whose detokenization raises ends alone with finish_reason "error"; the others go on.

A request with n > 1 runs in the core as n requests, sent by `ParallelSampling`
(`sluice.engine.frontend.parallel_sampling`): sample 0 at once, the others in `ProcessedOutputs.to_add`
once sample 0's first output came. Each sample has its own state here and its outputs carry the caller's
request id and the sample's `index`.

With a reasoning parser (`ModelConfig.reasoning_parser`), a chat request's text deltas are split by a
`ReasoningParser` (`sluice.engine.text.reasoning`) per sample: `RequestOutput.reasoning` holds the
reasoning delta and `text` the content delta; the tool calls are parsed from the content only. A
thinking chat's constraint (JSON, a required tool call, ...) applies once its reasoning has ended, as vLLM's
grammar: the core starts it after the output's first `</think>` token (`Constraint.after_token_id`). One
that writes `</think>` itself applies from the first token, as do all where the template closed the think
block (thinking off) or the request could not write the token (none in the vocabulary, or its
allowed_token_ids, stop_token_ids or a skipped special token rule it out: its output all content then).

The core may know a request by an id of its own (`add_request`'s `core_request_id`): the server's
engine gives each request a fresh one, so that an id its caller reuses at once (after a cancel, or after
a stop string ended the request here) never receives what the core still sends for the earlier request
of that id (its tokens of the step in flight, the answer to its abort). What the core sends for an
earlier request of a reused id is processed (its state forgotten once it ends) and never handed over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import msgspec

from sluice.engine.errors import InvalidRequestError
from sluice.engine.faults import FaultInjector
from sluice.engine.frontend.parallel_sampling import ParallelSampling, sample_request_ids
from sluice.engine.messages import AddRequest, CoreOutput
from sluice.engine.outputs import (
    NO_OUTPUT_LOGPROBS,
    NO_PROMPT_LOGPROBS,
    RequestOutput,
    Timings,
    ToolCall,
    Usage,
)
from sluice.engine.structured.tool_calls import ToolUse
from sluice.engine.text.detokenizer import IncrementalDetokenizer
from sluice.engine.text.reasoning import THINK_END, THINK_START, ReasoningParser, prompt_ends_reasoning

if TYPE_CHECKING:
    from sluice.engine.sampling_params import SamplingParams
    from sluice.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The prompt's last tokens where a template that turned thinking off wrote its empty think block
# (`<think>\n\n</think>\n\n`, and an end-of-turn or two before it), over a vocabulary without think tokens.
_PROMPT_TAIL_TOKENS = 16


@dataclass
class _RequestState:
    request_id: str  # the caller's id (the engine's id of a sample of an n-sample request differs)
    index: int  # which of the request's samples
    num_prompt_tokens: int
    arrival_time: float
    detokenizer: IncrementalDetokenizer | None
    num_output_tokens: int = 0
    num_accepted_draft_tokens: int = 0  # accepted drafts among the output tokens kept
    tool_use: ToolUse | None = None
    text: str = ""  # the whole output (its content, with a reasoning parser) so far, kept only with tools
    reasoning: ReasoningParser | None = None  # a chat request's, when the engine runs a reasoning parser
    superseded: bool = False  # a later request took the caller's id: this one's outputs go to no one


@dataclass
class ProcessedOutputs:
    """What the frontend hands its caller, and what it must send the core."""

    outputs: list[RequestOutput] = field(default_factory=list)
    # Engine ids of requests that finished here (stop string, failed detokenization, aborted) but still
    # run in the core.
    to_abort: list[str] = field(default_factory=list)
    # Samples 1 .. n - 1 of n-sample requests whose sample 0 gave its first output.
    to_add: list[AddRequest] = field(default_factory=list)


class OutputProcessor:
    """Owns the detokenizer of every live request."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        faults: FaultInjector | None = None,
        *,
        reasoning_parser: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._reasoning_parser = reasoning_parser  # a name of REASONING_PARSERS, for chat requests
        self._eos_token_ids = tuple(eos_token_ids)  # also where a chat's turns end
        # The token after which a thinking chat's constraint applies; None: it applies from the first token
        self._think_end_id = self._think_start_id = None
        if reasoning_parser is not None and tokenizer is not None:
            self._think_start_id = tokenizer.token_to_id(THINK_START)
            self._think_end_id = tokenizer.token_to_id(THINK_END)
            if self._think_end_id is None:
                # vLLM refuses it; the split is by text, so it works, but a model that never thinks gets
                # its whole answer as reasoning (deepseek_r1's output without </think>)
                logger.warning(
                    "reasoning_parser %s: the model's vocabulary has no %s token: its chats' outputs "
                    "without one are all reasoning, and their constraints apply from the first token",
                    reasoning_parser,
                    THINK_END,
                )
        # A special token, which skip_special_tokens drops from the text the split reads
        self._think_end_is_special = (
            self._think_end_id is not None and tokenizer.decode([self._think_end_id]) != THINK_END
        )
        if tokenizer is not None:
            _ = tokenizer.byte_level_vocab  # the detokenizers' table: built at start, not on a first request
        self._faults = faults
        self._states: dict[str, _RequestState] = {}  # engine request id -> state
        self._engine_ids: dict[str, list[str]] = {}  # caller's id -> engine ids of its live samples
        self._core_ids: dict[str, str] = {}  # caller's id -> the core's id of its live request
        self._samples = ParallelSampling()

    def add_request(
        self,
        add: AddRequest,
        tool_use: ToolUse | None = None,
        *,
        core_request_id: str | None = None,
        chat: bool = False,
    ) -> AddRequest:
        """Tracks the request's `add.params.n` samples; returns what to send to the core now (sample 0
        when n > 1). `tool_use`: the request's tools; its last output carries the tool calls parsed from
        its text. `core_request_id`: the id the core knows the request by, if not `add.request_id` (the
        module's docstring). `chat`: the prompt is a rendered chat, whose outputs the reasoning parser
        splits (when the engine runs one). Raises InvalidRequestError if an engine id of it belongs to
        another live request (`a#1` while `a` with n = 2 runs)."""
        request_id, params = add.request_id, add.params
        core_id = core_request_id or request_id
        engine_ids = sample_request_ids(core_id, params.n)
        for engine_id in engine_ids:
            owner = self.owner(engine_id)
            if owner is not None and owner != request_id:
                raise InvalidRequestError("request_id", f"{engine_id!r} is already in use by {owner!r}")
        splits_reasoning = chat and self._reasoning_parser is not None
        deferred = False
        closed_in_prompt = splits_reasoning and self._prompt_ends_reasoning(add.prompt_token_ids)
        constraint = params.constraint
        if splits_reasoning and not closed_in_prompt and constraint and not constraint.writes(THINK_END):
            if self._can_think(params):
                # As vLLM's grammar, it applies once the reasoning has ended: the think block is free.
                params = params.with_constraint(constraint.starting_after(self._think_end_id))
                deferred = True
            else:  # nothing it could start at: from the first token, the output all content
                splits_reasoning = False
        # Accepted (nothing above refused it): an earlier request of this id is abandoned.
        for engine_id in self._engine_ids.get(request_id, ()):
            self._states[engine_id].superseded = True
        for index, engine_id in enumerate(engine_ids):
            detokenizer = (
                None
                if self._tokenizer is None
                else IncrementalDetokenizer(self._tokenizer, params, add.prompt_token_ids)
            )
            reasoning = (
                ReasoningParser(
                    self._reasoning_parser, prompt_ends_reasoning=closed_in_prompt, only_think_end=deferred
                )
                if splits_reasoning
                else None
            )
            self._states[engine_id] = _RequestState(
                request_id,
                index,
                len(add.prompt_token_ids),
                add.arrival_time,
                detokenizer,
                tool_use=tool_use,
                reasoning=reasoning,
            )
        self._engine_ids[request_id] = list(engine_ids)
        self._core_ids[request_id] = core_id
        # The stop strings stay here, where the detokenizers match them: the core never reads them, and
        # they crossed the pipe once per sample (32 of 1 MB with n = 16: 512 MB, seconds of the loop).
        sent = replace(params, stop=()) if params.stop else params
        to_core = {"params": sent} if sent is not add.params else {}
        if core_id != request_id:
            to_core["request_id"] = core_id
        return self._samples.add(msgspec.structs.replace(add, **to_core) if to_core else add)

    def _can_think(self, params: SamplingParams) -> bool:
        """Whether a constrained chat's constraint can wait for `</think>`: the vocabulary has the token,
        the request can write it (`allowed_token_ids`, `stop_token_ids`: it would never start, or end the
        output first), and its text reaches the split (not a special token `skip_special_tokens` drops)."""
        think_end = self._think_end_id
        return (
            think_end is not None
            and (params.allowed_token_ids is None or think_end in params.allowed_token_ids)
            and think_end not in params.stop_token_ids
            and not (self._think_end_is_special and params.skip_special_tokens)
        )

    def _prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the chat template closed the think block in the prompt's last turn: thinking off, or an
        answer prefilled after the thought (`continue_final_message`). By the think tags' token ids where
        the vocabulary has them (the last tag back from the end, before an eos that ends an earlier turn),
        else by the text of the prompt's last tokens."""
        if self._tokenizer is None:
            return False
        if self._think_end_id is not None:
            tags = {self._think_end_id: True, self._think_start_id: False}
            for token_id in reversed(prompt_token_ids):
                if token_id in tags:
                    return tags[token_id]
                if token_id in self._eos_token_ids:
                    return False
            return False
        tail = self._tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return prompt_ends_reasoning(tail)

    def abort(self, request_ids: Iterable[str]) -> ProcessedOutputs:
        """Ends the requests (every sample): the last outputs of the samples never sent to the core, and
        in `to_abort` the engine ids of those the core holds. Unknown ids are skipped."""
        processed = ProcessedOutputs()
        for request_id in request_ids:
            core_id = self._core_ids.get(request_id)
            if core_id is None:  # ended: its id may be another live request's core id (`x@5`)
                continue
            unsent = self._samples.drop(core_id)
            processed.to_abort += [e for e in self._engine_ids.get(request_id, ()) if e not in unsent]
            processed.outputs += self.process([CoreOutput.aborted(e) for e in unsent]).outputs
        return processed

    @property
    def unsent_samples(self) -> tuple[int, int]:
        """(samples, their prompt tokens) of n-sample requests not sent to the core yet."""
        return self._samples.unsent

    @property
    def num_live_samples(self) -> int:
        """Sequences not yet finished: every sample of every live request, sent to the core or not."""
        return len(self._states)

    def owner(self, engine_id: str) -> str | None:
        """The caller's id of the live request that engine id `engine_id` belongs to, if any."""
        state = self._states.get(engine_id)
        return None if state is None else state.request_id

    def process(self, core_outputs: Sequence[CoreOutput]) -> ProcessedOutputs:
        """One `RequestOutput` per core output of a request still tracked here (and, when sample 0 of an
        n-sample request ended without ever running, one for each of its unsent samples)."""
        processed = ProcessedOutputs()
        states, samples = self._states, self._samples
        for core_output in core_outputs:
            state = states.get(core_output.request_id)
            if state is None:
                continue  # ended here already (stop string); the core's abort echo is dropped
            ended_alike: Sequence[CoreOutput] = ()
            if samples.num_waiting:
                to_add, ended_alike = samples.on_output(core_output)
                processed.to_add += to_add
            self._emit(processed, state, core_output)
            for one in ended_alike:
                self._emit(processed, states[one.request_id], one)
        return processed

    def _emit(self, processed: ProcessedOutputs, state: _RequestState, core_output: CoreOutput) -> None:
        output = self._process_one(state, core_output)
        if not state.superseded:
            processed.outputs.append(output)
        if output.finish_reason is not None:
            self._forget(core_output.request_id)
            if core_output.finish_reason is None:
                processed.to_abort.append(core_output.request_id)

    def _forget(self, engine_id: str) -> None:
        state = self._states.pop(engine_id)
        live = self._engine_ids.get(state.request_id, [])
        if engine_id in live:
            live.remove(engine_id)
        if not live:
            self._engine_ids.pop(state.request_id, None)
            self._core_ids.pop(state.request_id, None)

    def _process_one(self, state: _RequestState, core_output: CoreOutput) -> RequestOutput:
        finish_reason, stop_reason, error = (
            core_output.finish_reason,
            core_output.stop_reason,
            core_output.error,
        )
        try:
            text, stop_string, num_taken = self._detokenize(state, core_output)
        except Exception as exc:
            logger.exception("detokenizing request %s failed", core_output.request_id)
            text, stop_string, num_taken = "", None, len(core_output.new_token_ids)
            finish_reason, stop_reason, error = "error", None, f"detokenization failed: {exc}"
        # A stop string completed by a token in the middle of a multi-token advance drops the rest.
        state.num_output_tokens += num_taken
        # A step's tokens are its accepted drafts, then the target's own token: where a stop string keeps
        # only the first num_taken of them, only so many of its drafts count (never more than the output's
        # tokens after the first, which no draft gives).
        state.num_accepted_draft_tokens = min(
            core_output.num_accepted_draft_tokens, state.num_accepted_draft_tokens + num_taken
        )
        if stop_string is not None:
            # Also when the core finished it by length in the same step: the stop string decides.
            finish_reason, stop_reason = "stop", stop_string
        finished_time = core_output.finished_time
        if finish_reason is not None and finished_time is None:
            finished_time = time.time()
        token_ids, logprobs = core_output.new_token_ids, core_output.new_logprobs or NO_OUTPUT_LOGPROBS
        if num_taken < len(token_ids):
            token_ids, logprobs = token_ids[:num_taken], logprobs.first(num_taken)
        prompt_logprobs = core_output.prompt_logprobs
        reasoning = ""
        if state.reasoning is not None:
            reasoning, text = state.reasoning.feed(text, final=finish_reason is not None)
        try:
            tool_calls, content = self._tool_calls(state, text, finish_reason is not None)
        except Exception as exc:  # a parser's bug fails this request alone, never the engine's reader
            logger.exception("parsing the tool calls of request %s failed", core_output.request_id)
            tool_calls, content = (), ""
            finish_reason, stop_reason, error = "error", None, f"tool call parsing failed: {exc}"
        return RequestOutput(
            request_id=state.request_id,
            token_ids=tuple(token_ids),
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason if finish_reason is not None else None,
            error=error,
            usage=Usage(
                state.num_prompt_tokens,
                state.num_output_tokens,
                core_output.num_cached_tokens,
                core_output.num_prompt_tokens_computed,
                core_output.num_draft_tokens,
                state.num_accepted_draft_tokens,
            ),
            timings=Timings(
                state.arrival_time, core_output.first_scheduled, core_output.first_token, finished_time
            ),
            num_preemptions=core_output.num_preemptions,
            invalid_field=core_output.invalid_field,
            too_long=core_output.too_long,
            tool_calls=tool_calls,
            content=content,
            index=state.index,
            prompt_logprobs=NO_PROMPT_LOGPROBS if prompt_logprobs is None else prompt_logprobs,
            reasoning=reasoning,
        )

    def _tool_calls(
        self, state: _RequestState, text: str, finished: bool
    ) -> tuple[tuple[ToolCall, ...], str]:
        """A chat with tools: once finished, its calls and the content beside them."""
        if state.tool_use is None:
            return (), ""
        state.text += text
        calls = state.tool_use.parse(state.text) if finished else ()
        return calls, state.tool_use.content(state.text) if calls else ""

    def _detokenize(self, state: _RequestState, core_output: CoreOutput) -> tuple[str, str | None, int]:
        """The text delta, the stop string if one matched, and how many of the new tokens count (all
        of them, or those up to the one that completed the stop string)."""
        if self._faults is not None:
            self._faults.check("detokenize", [core_output.request_id])
        detokenizer = state.detokenizer
        if detokenizer is None:
            return "", None, len(core_output.new_token_ids)
        num_before = detokenizer.num_tokens
        token_ids = core_output.new_token_ids
        # The stop token (EOS, a stop_token_ids entry) ends the output but is no part of its text, also
        # with skip_special_tokens off (vLLM's detokenizer skips it too): a constrained output it ends
        # stays what the constraint matched. With include_stop_str_in_output it is, as in vLLM.
        skips_stop_token = (
            core_output.finish_reason == "stop"
            and isinstance(core_output.stop_reason, int)
            and not detokenizer.includes_stop_token
        )
        text = detokenizer.add_tokens(token_ids[:-1] if skips_stop_token else token_ids)
        cut_by_stop_string = detokenizer.stop_string is not None
        if core_output.finish_reason is not None and not cut_by_stop_string:
            # A stop string completed only here (by a U+FFFD) cuts no token; it ends no aborted or failed
            # output (it would turn "abort" into "stop").
            text += detokenizer.flush(match=core_output.finish_reason not in ("abort", "error"))
        num_taken = detokenizer.num_tokens - num_before
        if skips_stop_token and not cut_by_stop_string:
            num_taken += 1  # the stop token itself is kept in the token ids
        return text, detokenizer.stop_string, num_taken
