"""The server's engine: a frontend on the event loop in front of an engine core process.

event loop (this process; never imports torch)                    engine core process
----------------------------------------------                    -------------------
add_request(): tokenize, validate  ---- AddRequest ------------>  scheduler, model runner, sampler
abort(), abandoned streams         ---- AbortRequests --------->  blocks freed before the next step
RequestStream.put <- OutputProcessor <- CoreOutputs (one message per step, every request's tokens)
health / streams  <- on_dead  <- the core exited, failed a step, or stopped answering
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from sluice.engine.config import EngineConfig
from sluice.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from sluice.engine.faults import FaultInjector
from sluice.engine.frontend.core_client import HEARTBEAT_S, CoreClient
from sluice.engine.frontend.kv_event_log import KVEventLog
from sluice.engine.frontend.output_processor import OutputProcessor, ProcessedOutputs
from sluice.engine.frontend.request_stream import OutputCollector, RequestStream
from sluice.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreMessage,
    CoreOutput,
    CoreOutputs,
    StartProfile,
    StopProfile,
    checked_cache_salt,
    checked_priority,
)
from sluice.engine.model_info import ModelInfo
from sluice.engine.outputs import EngineStats, RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.tool_calls import ToolUse
from sluice.engine.text.chat_template import ChatTemplateOptions
from sluice.engine.text.prompt import check_prompt, prompt_context, resolve_prompt, truncated_prompt
from sluice.engine.text.tokenizer import Tokenizer

# Prompts longer than this (characters) are tokenized in a worker thread, off the event loop.
TOKENIZE_INLINE_MAX_CHARS = 4096

_T = TypeVar("_T")


@dataclass(frozen=True)
class EngineLiveness:
    """What the frontend sees of the core between its stats: `silence_s`, the time since the core's last
    message (a step's outputs, or an idle core's heartbeat) while requests are live, None while none is;
    `prefill_pending_tokens`, the prompt tokens of live requests that have had no output yet (the prefill
    work in hand, which a long silence may be)."""

    silence_s: float | None
    prefill_pending_tokens: int


def prompt_chars(
    text: str | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> int:
    """The characters a prompt gives the chat template and the tokenizer (the template's own text aside):
    every string in the messages (contents, tool calls' arguments, reasoning) and the tools (their
    schemas are rendered too: 200 tools of an agent, 500 KB, rendered inline stalled every stream for
    0.5 s), each with its JSON punctuation (quotes, brackets: 150,000 empty arrays render to 600 KB).
    Counting stops past TOKENIZE_INLINE_MAX_CHARS: every value counts 2 or more, so at most ~2,000 are
    visited however large the prompt."""
    count, limit = len(text or ""), TOKENIZE_INLINE_MAX_CHARS
    pending: list[Any] = [messages or (), tools or ()]
    while pending and count <= limit:
        value = pending.pop()
        if isinstance(value, str):
            count += len(value) + 2
        elif isinstance(value, Mapping):
            count += 2
            pending += value.keys()
            pending += value.values()
        elif isinstance(value, list | tuple):
            count += 2
            pending += value
        else:  # a number, a bool, None
            count += max(2, len(str(value)))
    return count


async def tokenize_when_long(num_chars: int, tokenize: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`tokenize(*args, **kwargs)`, in a worker thread when it reads more than TOKENIZE_INLINE_MAX_CHARS
    characters (the tokenizer releases the GIL, so the event loop streams on meanwhile), else inline, where
    a short prompt costs less than the hop."""
    if num_chars <= TOKENIZE_INLINE_MAX_CHARS:
        return tokenize(*args, **kwargs)
    return await asyncio.to_thread(tokenize, *args, **kwargs)


class AsyncEngine:
    """Construct, `await start()` (spawns the core and loads the model), serve, `await shutdown()`."""

    def __init__(
        self,
        config: EngineConfig,
        max_queue: int | None = None,
        *,
        stream_interval: int = 1,
        engine_timeout: float = 30.0,
        kv_events: bool = False,
    ) -> None:
        """`kv_events`: the core records the prefix cache's changes, for `kv_event_log`'s subscribers
        (every request's token ids: a router's feed, not a tenant's)."""
        if stream_interval < 1:
            raise ValueError("stream_interval: must be >= 1")
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue: must be >= 1 (None: unbounded), got {max_queue}")
        if not engine_timeout > HEARTBEAT_S:  # NaN too: the watchdog would never fire
            raise ValueError(
                f"engine_timeout: must be > {HEARTBEAT_S} s (the core's heartbeat), got {engine_timeout}"
            )
        self._client = CoreClient(config, timeout_seconds=engine_timeout, kv_events=kv_events)
        self._reasoning_parser = config.model.reasoning_parser
        self.kv_event_log = KVEventLog() if kv_events else None
        self._max_queue = max_queue
        self._stream_interval = stream_interval
        self._streams: dict[str, OutputCollector] = {}
        self._num_added = 0  # numbers the core's ids of requests (`_core_request_id`)
        self._dead_listeners: list[Callable[[str], None]] = []
        self.error: EngineDeadError | None = None
        self.tokenizer: Tokenizer | None = None
        self.model_info: ModelInfo | None = None
        self._output_processor: OutputProcessor | None = None
        self._stats: EngineStats | None = None
        self._last_message_at = time.monotonic()
        self._prefill_pending: dict[str, int] = {}  # live request id -> its prompt's tokens, until an output
        self._num_prefill_pending = 0  # their sum
        self._closed = False

    async def start(self) -> None:
        """Raises EngineDeadError if the core cannot load the model."""
        ready = await self._client.start(self._on_message, self._on_dead)
        self.model_info = ready.model_info
        self.tokenizer = None if ready.tokenizer is None else Tokenizer.from_spec(ready.tokenizer)
        self._output_processor = OutputProcessor(
            self.tokenizer,
            FaultInjector.from_env(),
            reasoning_parser=self._reasoning_parser,
            eos_token_ids=ready.model_info.eos_token_ids,
        )
        self._stats = EngineStats(0, 0, ready.model_info.num_kv_blocks, 0, 0, 0, 0)

    async def shutdown(self) -> None:
        """Stops the core process; what still runs ends with an "abort" output per sample (the core
        stops without answering, so they are made here), and later requests get EngineDeadError. From another
        event loop than `start`'s: RuntimeError, unless that one has closed (`CoreClient.shutdown`)."""
        self._client.check_loop(stopping=True)
        self._closed = True
        ended: list[RequestOutput] = []
        if self._streams and self.error is None:
            _, ended = self._end_here(list(self._streams))
        if self.kv_event_log is not None:
            self.kv_event_log.stop("the engine shut down")
        await self._client.shutdown()
        self._put(ended)

    @property
    def core_pid(self) -> int | None:
        return None if self._client.process is None else self._client.process.pid

    def on_dead(self, listener: Callable[[str], None]) -> None:
        """`listener(reason)` runs once if the engine core dies; at once if it has died already (as a
        future's done callback), so that a listener added after the load cannot miss an early death."""
        if self.error is not None:
            listener(str(self.error))
        else:
            self._dead_listeners.append(listener)

    def stats(self) -> EngineStats:
        """As of the core's latest step; the samples of n-sample requests held here until their first
        answers wait too (vLLM sends the n to its core at once). Safe from any thread: the metrics
        endpoint reads it from its own, while this one's loop replaces the stats and adds requests."""
        stats = self._stats
        num_unsent, unsent_tokens = self._output_processor.unsent_samples
        if not num_unsent:
            return stats
        return msgspec.structs.replace(
            stats,
            num_waiting=stats.num_waiting + num_unsent,
            num_waiting_tokens=stats.num_waiting_tokens + unsent_tokens,
        )

    def liveness(self) -> EngineLiveness:
        """The core's silence while requests are live, and their prefill not yet answered."""
        silence = time.monotonic() - self._last_message_at if self._streams else None
        return EngineLiveness(silence, self._num_prefill_pending)

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    def live_request_ids(self) -> list[str]:
        """Requests added and not yet ended for their callers (streams still open)."""
        return list(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    async def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        text: str | None = None,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        chat_options: ChatTemplateOptions | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        stream_interval: int | None = None,
        tool_use: ToolUse | None = None,
        use_speculation: bool = True,
    ) -> RequestStream:
        """Validates (raising InvalidRequestError, ContextLengthError, QueueFullError, EngineDeadError),
        queues the request in the core, and returns its stream.

        Abandoning the stream (cancelling the task that awaits it, `aclose()`, or dropping it) aborts the
        request, so its KV blocks are freed before the core's next step. `chat_options` (chat only): how the
        chat template renders `messages`. `tool_use` (chat only): tools rendered by the chat template, a
        required or named call enforced, calls parsed on the last output. A chat's outputs carry their
        reasoning apart when the engine runs a reasoning parser (`RequestOutput.reasoning`).
        With `params.n` > 1 the stream yields the outputs of the n samples (each with its `index`) and
        ends after the last one finished. `use_speculation` False: the request never verifies draft
        tokens (when the engine speculates).
        """
        self._check_accepting(request_id, params.n)
        priority, cache_salt = checked_priority(priority), checked_cache_salt(cache_salt)
        tools = None if tool_use is None else tool_use.for_template()
        prompt = await self._tokenize(
            text=text,
            token_ids=token_ids,
            messages=messages,
            tools=tools,
            chat_options=chat_options,
            context=prompt_context(params, self.model_info.max_model_len),
        )
        params = params if tool_use is None else tool_use.sampling_params(params)
        prompt = truncated_prompt(prompt, params, self.model_info)
        check_prompt(prompt, params, self.model_info, has_tokenizer=self.tokenizer is not None)
        self._check_accepting(request_id, params.n)  # again: tokenizing may have awaited
        collector = OutputCollector(stream_interval or self._stream_interval)
        add = AddRequest(request_id, prompt, params, time.time(), priority, cache_salt, use_speculation)
        core_request_id = self._core_request_id(request_id)
        first = self._output_processor.add_request(
            add, tool_use, core_request_id=core_request_id, chat=messages is not None
        )
        self._streams[request_id] = collector
        try:
            self._client.send(first)
        except BaseException:  # e.g. a value msgspec cannot encode: nothing of the request stays behind
            self._streams.pop(request_id, None)
            self._output_processor.abort([request_id])
            raise
        self._prefill_pending[request_id] = len(prompt)
        self._num_prefill_pending += len(prompt)
        return RequestStream(request_id, collector, self._abandon, num_samples=params.n)

    def start_profile(
        self, output_dir: str, num_steps: int, activities: list[str], record_shapes: bool, with_stack: bool
    ) -> None:
        """The core profiles its next `num_steps` forward steps (0: until `stop_profile`) into `output_dir`
        (the caller checked the arguments); nothing is awaited: the files appear when the steps have run.
        EngineDeadError once the engine died or was shut down."""
        self._check_live()
        self._client.send(StartProfile(output_dir, num_steps, activities, record_shapes, with_stack))

    def stop_profile(self) -> None:
        self._check_live()
        self._client.send(StopProfile())

    async def abort(self, request_id: str) -> None:
        """Aborts a live request (every sample of it); its stream ends with finish_reason "abort".
        Unknown ids are ignored."""
        stream = self._streams.get(request_id)
        if stream is not None and self.error is None:
            for output in self._send(self._output_processor.abort([request_id])):
                stream.put(output)  # samples never sent to the core

    def abort_all_now(self) -> None:
        """Aborts every live request, and ends its stream now, with finish_reason "abort" and the tokens
        it has, instead of a step later with the core's answer (dropped when it comes): the drain's end,
        where the step under way may run for seconds on a CPU (a long prompt's chunk) and the server stops
        right after."""
        if not self._streams or self.error is not None or self._closed:
            return
        to_abort, ended = self._end_here(list(self._streams))
        if to_abort:
            self._client.send(AbortRequests(to_abort))
        self._put(ended)

    def _end_here(self, request_ids: list[str]) -> tuple[list[str], list[RequestOutput]]:
        """Ends the requests here: every sample's last output ("abort"; those the core holds made here as
        it would send them), and the engine ids of the samples the core holds."""
        processed = self._output_processor.abort(request_ids)
        in_core = [CoreOutput.aborted(engine_id) for engine_id in processed.to_abort]
        return processed.to_abort, processed.outputs + self._output_processor.process(in_core).outputs

    def _put(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if (stream := self._streams.get(output.request_id)) is not None:
                stream.put(output)

    def _check_live(self) -> None:
        """EngineDeadError once the core died or was shut down (its sockets are closed then)."""
        if self.error is not None:  # a new one: re-raising the kept one chained each call's frames onto it
            raise EngineDeadError(str(self.error))
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        self._client.check_loop()

    def _check_accepting(self, request_id: str, num_samples: int) -> None:
        self._check_live()
        if not request_id:
            raise InvalidRequestError("request_id", "must not be empty")
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if self._max_queue is None:
            return
        # Sequences on both sides: a request with n samples is n of them. One that would take the queue
        # past its bound is refused, unless nothing waits: a request of more samples than the bound still
        # runs, alone in the queue.
        if (num_queued := self._num_queued()) and num_queued + num_samples > self._max_queue:
            these = "" if num_samples == 1 else f", this request's {num_samples} samples"
            raise QueueFullError(
                f"the waiting queue is full ({num_queued} sequences waiting{these}, max_queue "
                f"{self._max_queue}); retry in {QueueFullError.retry_pushback_ms} ms"
            )

    def _num_queued(self) -> int:
        """Sequences waiting, as the core will find them at its next step. Those added since its last
        report are not running yet: while it reported none waiting they take its free seats first
        (max_num_seqs), so an idle server takes a burst it can run at once; while it holds some back
        (seats or KV cache full), every sequence not reported running waits. A request whose grammar
        compiles holds no other back: it takes a free seat once its grammar is ready."""
        num_live, stats = self._output_processor.num_live_samples, self._stats
        if stats.num_waiting > stats.num_waiting_for_grammar or not self.model_info.max_num_seqs:
            return max(0, num_live - stats.num_running)
        return max(0, num_live - self.model_info.max_num_seqs)

    def _core_request_id(self, request_id: str) -> str:
        """A fresh id for the core: a caller may reuse `request_id` as soon as its stream ended (it was
        abandoned, aborted, or a stop string ended it here) while the core, a step behind, still sends
        outputs for the earlier request of that id; those must not reach the new request's stream (the
        OutputProcessor's docstring). Unique: no id of this engine's ends with "@" and another number."""
        self._num_added += 1
        return f"{request_id}@{self._num_added}"

    async def _tokenize(self, **prompt: Any) -> list[int]:
        size = prompt_chars(prompt["text"], prompt["messages"], prompt["tools"])
        return await tokenize_when_long(size, resolve_prompt, self.tokenizer, **prompt)

    def _abandon(self, request_id: str, finished: bool) -> None:
        """A stream ended: forget it, and abort its request unless it had finished."""
        self._streams.pop(request_id, None)
        self._answered(request_id)
        if not finished and self.error is None and not self._closed:
            self._send(self._output_processor.abort([request_id]))

    def _answered(self, request_id: str) -> None:
        """The request had an output (or ended): its prefill is no longer pending."""
        self._num_prefill_pending -= self._prefill_pending.pop(request_id, 0)

    def _on_message(self, message: CoreMessage) -> None:
        self._stats = message.stats
        self._last_message_at = time.monotonic()
        if self.kv_event_log is not None:
            if isinstance(message, CoreOutputs) and message.kv_events:
                self.kv_event_log.publish(message.kv_events)
            self.kv_event_log.note_load()  # after the step's batch: its load goes with it
        if not isinstance(message, CoreOutputs):
            return
        for output in self._send(self._output_processor.process(message.outputs)):
            stream = self._streams.get(output.request_id)
            if stream is not None:
                self._answered(output.request_id)
                stream.put(output)

    def _send(self, processed: ProcessedOutputs) -> list[RequestOutput]:
        """Sends the core what `processed` asks (aborts, then samples 1 .. n - 1 of n-sample requests
        whose sample 0 answered); returns its outputs."""
        if processed.to_abort:
            self._client.send(AbortRequests(processed.to_abort))
        for add in processed.to_add:
            self._client.send(add)
        return processed.outputs

    def _on_dead(self, reason: str) -> None:
        self.error = EngineDeadError(reason)
        if self.kv_event_log is not None:
            self.kv_event_log.stop(reason)
        for stream in list(self._streams.values()):
            stream.fail(EngineDeadError(reason))
        for listener in self._dead_listeners:
            listener(reason)
