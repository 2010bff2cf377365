"""asyncio front of the engine: the step loop runs in a background thread, requests stream outputs.

event loop (callers)                       engine thread
--------------------                       -------------
add_request() --validate--> inbox  ----->  engine.add_request()
abort()       ------------> inbox  ----->  engine.abort()       (before the next step)
per-request asyncio.Queue  <--call_soon_threadsafe--  engine.step() outputs
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from engine.frontend.engine import Engine
from engine.loading.model_loader import ModelSource
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from engine.text.prompt import resolve_prompt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float


@dataclass(frozen=True)
class _Abort:
    request_id: str


class RequestStream:
    """The outputs of one request, as an async iterator.

    However the caller lets go of it (reads to the end, `aclose()`, cancels the task awaiting it, or
    drops it without ever iterating), `on_close(request_id, finished)` runs exactly once, so an
    unfinished request is aborted and its KV blocks freed.
    """

    def __init__(self, request_id: str, on_close: Callable[[str, bool], None]) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._on_close: Callable[[str, bool], None] | None = on_close
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._on_close is None:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:  # cancelled while waiting: the caller is gone
            self._close()
            raise
        if isinstance(item, BaseException):
            self._close()
            raise item
        if item.finished:
            self._finished = True
            self._close()
        return item

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close(self.request_id, self._finished)

    def __del__(self) -> None:
        self._close()


class AsyncEngine:
    """Thread-safe, asyncio-facing engine. Construct (blocking: loads the model), then `await start()`."""

    def __init__(
        self, config: EngineConfig, max_queue: int | None = None, source: ModelSource | None = None
    ) -> None:
        self._engine = Engine(config, source)
        self.tokenizer = self._engine.tokenizer
        self.model_info = self._engine.model_info
        self._max_queue = max_queue
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._stats = self._engine.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Aborts what is still running and stops the engine thread."""
        if self._thread is None:
            return
        for request_id in list(self._streams):
            self._inbox.put(_Abort(request_id))
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its latest step."""
        return self._stats

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    def live_request_ids(self) -> list[str]:
        """Requests added and not yet ended for their callers (streams still open)."""
        return list(self._streams)

    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        text: str | None = None,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Validates now (raising InvalidRequestError, ContextLengthError, QueueFullError), then streams.

        Abandoning the returned stream (cancelling the task that awaits it, `aclose()`, or dropping it)
        aborts the request, so its KV blocks are freed before the next engine step.
        """
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        if not request_id:
            raise InvalidRequestError("request_id", "must not be empty")
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        prompt = resolve_prompt(self.tokenizer, text=text, token_ids=token_ids, messages=messages)
        self._engine.check_prompt(prompt, params)
        num_queued = len(self._streams) - self._stats.num_running
        if self._max_queue is not None and num_queued >= self._max_queue:
            raise QueueFullError(f"the waiting queue is full ({self._max_queue} requests); retry later")
        stream = RequestStream(request_id, self._abandon)
        self._streams[request_id] = stream.queue
        self._inbox.put(_Add(request_id, prompt, params, priority, cache_salt, time.time()))
        return stream

    async def abort(self, request_id: str) -> None:
        """Aborts a live request; its stream ends with finish_reason "abort". Unknown ids are ignored."""
        if request_id in self._streams:
            self._inbox.put(_Abort(request_id))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def _abandon(self, request_id: str, finished: bool) -> None:
        """A stream ended: forget it, and abort its request unless it had finished."""
        self._streams.pop(request_id, None)
        if not finished:
            self._inbox.put(_Abort(request_id))

    def _run(self) -> None:
        """The engine thread: apply commands, step while there is work, hand outputs to the loop."""
        try:
            while self._apply_commands(block=not self._engine.has_unfinished_requests()):
                self._publish(self._engine.step())
        except BaseException as exc:  # the loop must report, never die silently
            logger.exception("engine loop failed")
            self._error = exc
            message = f"the engine stopped: {exc}"
            # Requests the engine holds end with finish_reason "error" and free their blocks; streams
            # whose requests never reached it (still in the inbox) get EngineDeadError.
            with contextlib.suppress(Exception):
                self._publish(self._engine.abort(self._engine.unfinished_request_ids(), error=message))
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(message))

    def _apply_commands(self, block: bool) -> bool:
        """Drains the inbox (waiting for one command when idle). False once shutdown was asked."""
        while True:
            try:
                command = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, _Abort):
                self._publish(self._engine.abort([command.request_id]))
            else:
                self._add(command)

    def _add(self, command: _Add) -> None:
        try:
            self._engine.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                priority=command.priority,
                cache_salt=command.cache_salt,
                arrival_time=command.arrival_time,
            )
        except InvalidRequestError as exc:
            self._loop.call_soon_threadsafe(self._deliver_error, command.request_id, exc)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Refreshes the stats snapshot and hands outputs to the event loop."""
        self._stats = self._engine.stats()
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)
