"""One request's outputs as an async iterator that never makes the engine wait for its reader."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from engine.outputs import Logprobs, RequestOutput


class OutputCollector:
    """The engine side `put`s each step's delta and never blocks; `get` returns them merged.

    A reader slower than the engine finds every delta since its last read merged into one output
    (token ids, text and logprobs concatenated in order; usage, timings and finish of the newest), so a
    request holds at most one pending output however slow its reader. With `stream_interval` n > 1 an
    output is handed over once it holds n tokens, or the request finished.
    """

    def __init__(self, stream_interval: int = 1) -> None:
        self._stream_interval = stream_interval
        self._ready = asyncio.Event()
        self._latest: RequestOutput | None = None  # newest delta not yet read
        self._token_ids: list[int] = []  # every pending delta's tokens, text and logprobs, in order
        self._texts: list[str] = []
        self._logprobs: list[Logprobs] = []
        self._error: BaseException | None = None

    def put(self, output: RequestOutput) -> None:
        self._latest = output
        self._token_ids.extend(output.token_ids)
        self._texts.append(output.text)
        self._logprobs.extend(output.logprobs)
        if output.finished or len(self._token_ids) >= self._stream_interval:
            self._ready.set()

    def fail(self, error: BaseException) -> None:
        """`get` raises `error` once the pending output, if any, was taken."""
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        if self._latest is None:
            self._ready.set()
            raise self._error
        output = dataclasses.replace(
            self._latest,
            token_ids=tuple(self._token_ids),
            text="".join(self._texts),
            logprobs=tuple(self._logprobs),
        )
        self._latest = None
        self._token_ids, self._texts, self._logprobs = [], [], []
        if self._error is not None:
            self._ready.set()
        return output


class RequestStream:
    """A request's outputs, as an async iterator over its `OutputCollector`.

    However the caller lets go of it (reads to the end, `aclose()`, cancels the task awaiting it, or
    drops it without ever iterating), `on_close(request_id, finished)` runs exactly once, so an
    unfinished request is aborted and its KV blocks freed. The engine keeps only the collector, so a
    dropped stream is collected.
    """

    def __init__(
        self, request_id: str, collector: OutputCollector, on_close: Callable[[str, bool], None]
    ) -> None:
        self.request_id = request_id
        self._collector = collector
        self._on_close: Callable[[str, bool], None] | None = on_close
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
