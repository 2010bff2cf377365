"""One request's outputs as an async iterator that never makes the engine wait for its reader."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from sluice.engine.outputs import NO_PROMPT_LOGPROBS, OutputLogprobs, RequestOutput

# The most tokens one merged output takes (more when its stream_interval asks for more): at 20 logprobs a
# token is about 230 bytes of a chunk, so a chunk stays far below a gRPC client's default 4 MB receive
# limit. Unbounded, a reader that paused while 48,000 tokens were made got one chunk of 6.3 MB, which
# failed its call (RESOURCE_EXHAUSTED) and lost every token.
MAX_MERGED_TOKENS = 4096


class _Pending:
    """One sample's deltas not yet read, merged when read (a reader keeping up reads them one by one)."""

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.num_tokens = 0

    @property
    def latest(self) -> RequestOutput:
        return self.outputs[-1]

    def add(self, output: RequestOutput) -> None:
        self.outputs.append(output)
        self.num_tokens += len(output.token_ids)

    def take(self, max_tokens: int) -> RequestOutput:
        """The oldest deltas merged, and taken: all of them, or as many as hold at most `max_tokens`
        tokens (one at least). A refusal (`invalid_field`: its reader gets a status, no chunk) is never
        merged into the tokens before it: those are taken first, and the refusal stays."""
        outputs = self.outputs
        end = len(outputs) - 1 if len(outputs) > 1 and outputs[-1].invalid_field is not None else len(outputs)
        num_taken = len(outputs[0].token_ids)
        for count in range(1, end):
            num_taken += len(outputs[count].token_ids)
            if num_taken > max_tokens:
                end = count
                break
        self.outputs = outputs[end:]
        self.num_tokens = sum(len(output.token_ids) for output in self.outputs)
        return _merged(outputs[:end])


def _merged(outputs: list[RequestOutput]) -> RequestOutput:
    """Deltas of one sample, oldest first, as one: tokens, text, reasoning and logprobs concatenated; the
    rest the newest's."""
    if len(outputs) == 1:
        return outputs[0]
    return msgspec.structs.replace(
        outputs[-1],
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        text="".join(o.text for o in outputs),
        reasoning="".join(o.reasoning for o in outputs),
        logprobs=OutputLogprobs.joined([o.logprobs for o in outputs]),
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), NO_PROMPT_LOGPROBS),
    )


class OutputCollector:
    """The engine side `put`s each step's delta and never blocks; `get` returns them merged.

    A reader slower than the engine finds the deltas since its last read merged into one output
    (token ids, text and logprobs concatenated in order; usage, timings and finish of the newest), of
    at most MAX_MERGED_TOKENS tokens (the rest come in the next ones). With `stream_interval`
    n > 1 an output is handed over once it holds n tokens, or its sample finished. The samples of an
    n-sample request (`RequestOutput.index`) are merged separately and handed over oldest first. A
    refusal (an output with `invalid_field`) is handed over on its own, after the tokens before it.
    """

    def __init__(self, stream_interval: int = 1) -> None:
        self._stream_interval = stream_interval
        self._ready = asyncio.Event()
        self._pending: dict[int, _Pending] = {}  # sample index -> its unread deltas, oldest first
        self._error: BaseException | None = None

    def put(self, output: RequestOutput) -> None:
        pending = self._pending.get(output.index)
        if pending is None:
            pending = self._pending[output.index] = _Pending()
        pending.add(output)
        if self._is_ready(pending):
            self._ready.set()

    def fail(self, error: BaseException) -> None:
        """`get` raises `error` once the pending outputs, if any, were taken."""
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        index = next((i for i, p in self._pending.items() if self._is_ready(p)), None)
        if index is None:
            self._ready.set()
            raise self._error
        pending = self._pending[index]
        output = pending.take(max(MAX_MERGED_TOKENS, self._stream_interval))
        if not pending.outputs:
            del self._pending[index]
        if self._error is not None or any(self._is_ready(p) for p in self._pending.values()):
            self._ready.set()
        return output

    def _is_ready(self, pending: _Pending) -> bool:
        return (
            self._error is not None or pending.latest.finished or pending.num_tokens >= self._stream_interval
        )


class RequestStream:
    """A request's outputs, as an async iterator over its `OutputCollector`; with `num_samples` n > 1 it
    ends after the last output of each of the n samples.

    However the caller lets go of it (reads to the end, `aclose()`, cancels the task awaiting it, or
    drops it without ever iterating), `on_close(request_id, finished)` runs exactly once, so an
    unfinished request is aborted and its KV blocks freed. The engine keeps only the collector, so a
    dropped stream is collected.
    """

    def __init__(
        self,
        request_id: str,
        collector: OutputCollector,
        on_close: Callable[[str, bool], None],
        num_samples: int = 1,
    ) -> None:
        self.request_id = request_id
        self._collector = collector
        self._on_close: Callable[[str, bool], None] | None = on_close
        self._num_unfinished = num_samples  # the stream ends after every sample's last output
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._on_close is None:
            raise StopAsyncIteration
        try:
            output = await self._collector.get()
        except BaseException:  # the engine failed, or the caller was cancelled while waiting
            self._close()
            raise
        if output.finished:
            self._num_unfinished -= 1
            if self._num_unfinished == 0:
                self._finished = True
                self._close()
        return output

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close(self.request_id, self._finished)

    def __del__(self) -> None:
        self._close()
