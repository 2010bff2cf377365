"""Offline batch API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sluice.engine.config import EngineConfig
from sluice.engine.frontend.deferred_interrupt import DeferredInterrupt
from sluice.engine.frontend.engine import Engine
from sluice.engine.outputs import (
    NO_OUTPUT_LOGPROBS,
    Logprobs,
    OutputLogprobs,
    RequestOutput,
    Timings,
    ToolCall,
)
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.tool_calls import ToolUse
from sluice.engine.text.chat_template import ChatTemplateOptions
from sluice.engine.text.prompt import resolve_prompt

# Text, token ids, or vLLM's prompt dicts of them: TextPrompt {"prompt": str}, TokensPrompt
# {"prompt_token_ids": [int, ...]}.
Prompt = str | Sequence[int] | Mapping[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass
class Completion:
    """Everything one request (one sample of it, when n > 1) produced, accumulated over its outputs.

    `logprobs` (when asked for): one per token, read as `Logprobs`, set when the sample finishes (its
    outputs' columns joined once, not copied at every output).
    `prompt_logprobs` (when asked for): one per prompt token after the first, on sample 0.
    `prompt_tokens_computed`: prompt tokens this sample ran through the model, those not found in the
    prefix cache (samples 1.. of an n-sample request find sample 0's full prompt blocks there).
    """

    request_id: str
    prompt_token_ids: list[int]
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # with a reasoning parser, a chat's content: the output after its think block
    reasoning: str = ""  # with a reasoning parser, a chat's reasoning
    logprobs: OutputLogprobs = NO_OUTPUT_LOGPROBS
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why, when finish_reason is "error" (e.g. a sampler that raised for it)
    cached_tokens: int = 0
    num_preemptions: int = 0
    draft_tokens: int = 0  # speculative decoding: drafts verified for this request, and accepted
    accepted_draft_tokens: int = 0
    timings: Timings | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    content: str = ""  # with tool_calls: the text outside them
    prompt_logprobs: list[Logprobs] = field(default_factory=list)
    prompt_tokens_computed: int = 0
    _logprobs_parts: list[OutputLogprobs] = field(default_factory=list, init=False, repr=False, compare=False)

    def add(self, output: RequestOutput) -> None:
        self.token_ids.extend(output.token_ids)
        self.text += output.text
        self.reasoning += output.reasoning
        if output.logprobs:
            self._logprobs_parts.append(output.logprobs)
        self.prompt_logprobs.extend(output.prompt_logprobs)
        if output.finished:
            self.logprobs = OutputLogprobs.joined(self._logprobs_parts)
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
            self.error = output.error
            self.cached_tokens = output.usage.cached_tokens if output.usage else 0
            self.prompt_tokens_computed = output.usage.prompt_tokens_computed if output.usage else 0
            self.draft_tokens = output.usage.draft_tokens if output.usage else 0
            self.accepted_draft_tokens = output.usage.accepted_draft_tokens if output.usage else 0
            self.num_preemptions = output.num_preemptions
            self.timings = output.timings
            self.tool_calls = output.tool_calls
            self.content = output.content

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the sampled tokens' logprobs (as `logprobs` gives them), None when there
        are none (logprobs not asked for)."""
        return math.fsum(self.logprobs.logprobs) if self.logprobs.token_ids else None

    def as_message(self) -> dict[str, Any]:
        """The assistant message that continues the conversation: the text, or the tool calls and the
        content beside them (then add a {"role": "tool", "tool_call_id": call.id, "content": ...}
        message per call); the reasoning, if any, as "reasoning_content"."""
        content = self.content if self.tool_calls else self.text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.tool_calls:
            message["tool_calls"] = [asdict(call) for call in self.tool_calls]
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        return message


class LLM:
    """Runs many prompts to completion on one engine, with continuous batching.

    Keyword arguments name fields of the config sections (`ModelConfig`, `CacheConfig`, `SchedulerConfig`,
    ...: e.g. `block_size=16, num_blocks=64, max_num_batched_tokens=256, enable_prefix_caching=False`) or
    of `EngineConfig` (`attention_backend`, `enforce_eager`, `speculative=SpeculativeConfig(...)`); see
    `EngineConfig.from_kwargs`.

    Calls from several threads run one at a time (each steps the engine until its own requests finish).
    """

    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        self.engine = Engine(EngineConfig.from_kwargs(model, **kwargs))
        self._next_id = 0
        # Two threads stepping the one engine took each other's outputs: one failed (KeyError), the other
        # returned completions short of the tokens the first had taken.
        self._running = threading.Lock()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Completions in the order of `prompts`. A single prompt (str, token ids, or vLLM's
        {"prompt": text} / {"prompt_token_ids": ids}) is one request. A prompt whose sampling params have
        n > 1 gives n consecutive completions (`index` 0 .. n - 1). `priority`: one a prompt (vLLM's
        name; lower runs first)."""
        if isinstance(prompts, bytes):
            raise ValueError("prompts: bytes are neither text nor token ids; decode them to a str")
        if isinstance(prompts, Iterator):  # a generator: taken as the list it yields
            prompts = list(prompts)
        if isinstance(prompts, str | Mapping) or (
            prompts and not isinstance(prompts[0], str | Sequence | Mapping)
        ):
            prompts = [prompts]  # one prompt: text, token ids or a prompt dict
        token_ids = [self._encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        return self._run(token_ids, sampling_params, priority)

    def chat(
        self,
        messages: Sequence[Sequence[Mapping[str, Any]]] | Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tool_use: ToolUse | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[Completion]:
        """`messages`: one conversation (a list of messages), or a list of them, as vLLM takes them.
        `tool_use`: tools for every conversation (see `sluice.engine.structured.tool_calls`); the
        completions then carry the parsed `tool_calls`. The rest, as vLLM's `LLM.chat` names them, say
        how the chat template renders every conversation (`ChatTemplateOptions`): extra template
        variables (e.g. {"enable_thinking": False}), the generation prompt after it, or the prompt
        ending inside its last (assistant) message."""
        conversations = list(messages) if isinstance(messages, Iterator) else messages  # a generator's list
        if conversations and isinstance(conversations[0], Mapping):  # one conversation
            conversations = [conversations]
        for i, conversation in enumerate(conversations):
            if isinstance(conversation, str | bytes | Mapping) or not isinstance(conversation, Sequence):
                raise ValueError(
                    f"messages[{i}]: must be a list of messages (role, content), got {conversation!r}"
                )
        tools = None if tool_use is None else tool_use.for_template()
        options = ChatTemplateOptions(
            chat_template_kwargs or {}, add_generation_prompt, continue_final_message
        )
        token_ids = [
            resolve_prompt(self.engine.tokenizer, messages=c, tools=tools, chat_options=options)
            for c in conversations
        ]
        return self._run(token_ids, sampling_params, None, tool_use, chat=True)

    def _encode(self, prompt: Prompt, name: str) -> list[int]:
        if isinstance(prompt, Mapping):  # a dict had been read as token ids: KeyError 0
            if len(prompt) != 1 or next(iter(prompt)) not in PROMPT_KEYS:
                raise ValueError(f"{name}: a prompt dict holds one of {PROMPT_KEYS}, got keys {list(prompt)}")
            ((key, prompt),) = prompt.items()
            if (key == "prompt") != isinstance(prompt, str):
                raise ValueError(f"{name}: {key!r} takes {'text' if key == 'prompt' else 'token ids'}")
        if isinstance(prompt, str):
            return resolve_prompt(self.engine.tokenizer, text=prompt)
        return resolve_prompt(self.engine.tokenizer, token_ids=prompt)

    def _run(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        priorities: Sequence[int] | None,
        tool_use: ToolUse | None = None,
        *,
        chat: bool = False,
    ) -> list[Completion]:
        params, priorities = (list(v) if isinstance(v, Iterator) else v for v in (params, priorities))
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompt_token_ids)
        elif isinstance(params, str | bytes) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(
                f"sampling_params: must be a SamplingParams or a list of them, one per prompt, got {params!r}"
            )
        for name, values in (("sampling_params", params), ("priority", priorities)):
            if values is not None and len(values) != len(prompt_token_ids):
                raise ValueError(f"{name}: {len(values)} entries for {len(prompt_token_ids)} prompts")
        if tool_use is not None:
            params = [tool_use.sampling_params(p) for p in params]
        completions: dict[tuple[str, int], Completion] = {}  # (request id, sample index)
        # Ctrl-C lands between steps (DeferredInterrupt), so the abort below finds consistent state.
        with self._running, DeferredInterrupt() as interrupt:
            try:
                for i, (ids, p) in enumerate(zip(prompt_token_ids, params, strict=True)):
                    request_id = f"llm-{self._next_id}"
                    self._next_id += 1
                    priority = priorities[i] if priorities else 0
                    queued = self.engine.add_request(
                        request_id, ids, p, priority=priority, tool_use=tool_use, chat=chat
                    )
                    for index in range(p.n):
                        completions[request_id, index] = Completion(request_id, list(queued), index)
                    interrupt.deliver()
                while self.engine.has_work():  # the last step frees the finished requests' state
                    for output in self.engine.step():
                        if output.invalid_field is not None:
                            raise output.refusal()
                        completions[output.request_id, output.index].add(output)
                    interrupt.deliver()
            except BaseException:
                # A rejected prompt or an interrupted run must not leave requests behind for the next
                # call, nor, with async scheduling, the steps they were in.
                self.engine.abort(list(dict.fromkeys(request_id for request_id, _ in completions)))
                if not self.engine.has_unfinished_requests():
                    self.engine.core.discard_in_flight()
                raise
        return list(completions.values())
