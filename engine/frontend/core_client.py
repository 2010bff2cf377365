"""Starts the engine core process and talks to it over ZeroMQ IPC sockets, from the event loop.

    frontend (event loop)                                  engine core process
    send(AddRequest | AbortRequests) --PUSH commands-->    sluice.engine.process.core_process.CoreLoop
    on_message(CoreOutputs | CoreHeartbeat) <--PULL results--  (CoreBusy: heard from, nothing to handle)
    on_dead(reason)  <- the process exited, said CoreFailed, or sent nothing for `timeout_seconds`

`on_dead` runs once, on the event loop; the process is killed if it still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from collections.abc import Callable

import zmq

from sluice.engine.config import EngineConfig
from sluice.engine.errors import EngineDeadError
from sluice.engine.messages import (
    SOCKET_DIRECTORY_PREFIX,
    CoreBusy,
    CoreConfig,
    CoreFailed,
    CoreMessage,
    CoreReady,
    FrontendMessage,
    Shutdown,
    decode_core_message,
    encode,
)
from sluice.engine.process.child_process import ChildProcess
from sluice.engine.process.threads import core_process_environment

logger = logging.getLogger(__name__)


HEARTBEAT_S = 0.5  # an idle core says it is alive this often
# How long `shutdown` waits for the core to exit once asked before it kills it.
CORE_EXIT_TIMEOUT_S = 10.0


class CoreClient:
    """One engine core process. `await start(...)` returns once the model is loaded."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        heartbeat_seconds: float = HEARTBEAT_S,
        timeout_seconds: float = 30.0,
        kv_events: bool = False,
    ) -> None:
        self.config = config
        self.kv_events = kv_events  # the core records the prefix cache's changes (CoreOutputs.kv_events)
        self.heartbeat_seconds = heartbeat_seconds
        self.timeout_seconds = timeout_seconds
        self.process: ChildProcess | None = None
        self._directory: str | None = None  # the sockets' directory, made by `start`
        # Commands go out without waiting (no high-water mark). Results are read from the event loop
        # through the socket's file descriptor (`_next_result`), not through zmq.asyncio and its future and
        # event poll per message (92 against 62 us of CPU a message on a 2-core EPYC: docs/BENCHMARKS.md).
        self._context = zmq.Context()
        # Linger 0 on every socket: a client dropped without `shutdown` (a failed start, a test's failed
        # teardown) must not block its context's garbage collection waiting to deliver to a dead core.
        self._context.setsockopt(zmq.LINGER, 0)
        self._commands = self._context.socket(zmq.PUSH)
        self._results = self._context.socket(zmq.PULL)
        # A client dropped without `shutdown` inside a reference cycle (an AsyncEngine never started, or
        # one whose owner failed) hung the garbage collector: the cycle's weak references (the context's
        # list of its sockets) are cleared before its finalizers run, so the context's __del__ terminated
        # it with its sockets still open, which zmq waits for forever. The finalizer holds them strongly
        # and closes them first.
        self._sockets_closer = weakref.finalize(
            self, _close_sockets, self._context, (self._commands, self._results)
        )
        self._results_readable: asyncio.Event | None = None  # set when the results fd is readable
        self._tasks: list[asyncio.Task[None]] = []
        self._last_heard = time.monotonic()
        self._long_step_logged = False  # the step running now was logged as long (CoreBusy)
        self._on_dead: Callable[[str], None] | None = None
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None  # `start`'s, whose tasks read the results

    async def start(
        self, on_message: Callable[[CoreMessage], None], on_dead: Callable[[str], None]
    ) -> CoreReady:
        """Spawns the core, sends it the config and waits for `CoreReady`.

        Raises EngineDeadError if the model fails to load or the process exits first, RuntimeError if this
        client was started before (a second core behind the same sockets took the first's messages: it hung).
        """
        if self._loop is not None or self._closing:
            raise RuntimeError("the engine core was started before: an engine starts once (make a new one)")
        self._loop = asyncio.get_running_loop()
        try:
            # Encoded before the core exists: a config that cannot be sent must not leave a core waiting.
            config = encode(CoreConfig(self.config, self.heartbeat_seconds, self.kv_events))
            self._directory = tempfile.mkdtemp(prefix=SOCKET_DIRECTORY_PREFIX)
            commands, results = f"ipc://{self._directory}/commands", f"ipc://{self._directory}/results"
            self._commands.setsockopt(zmq.SNDHWM, 0)
            # The core binds the commands address; connecting first queues the config until it does.
            self._commands.connect(commands)
            self._results.bind(results)
            self._results_readable = asyncio.Event()
            asyncio.get_running_loop().add_reader(self._results.FD, self._results_readable.set)
            # Not the loop's create_subprocess_exec: uvloop's runs Python in a forked child (child_process).
            # -P: the working directory is not put first on sys.path, where a queue.py or types.py of the
            # caller's would shadow the standard library's in the core.
            self.process = ChildProcess(
                [sys.executable, "-P", "-m", "sluice.engine.process.core_process", "--commands", commands,
                 "--results", results, "--parent-pid", str(os.getpid())],
                env=core_process_environment(os.environ),
            )  # fmt: skip
            self._commands.send(config, zmq.NOBLOCK)
            ready = await self._wait_ready()
        except BaseException:  # failed, or cancelled while the model loads: nothing outlives its start
            self.kill()
            self._release()
            raise
        self._on_dead = on_dead
        self._last_heard = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._receive(on_message)),
            asyncio.create_task(self._watch_exit()),
            asyncio.create_task(self._watch_silence()),
        ]
        return ready

    def send(self, message: FrontendMessage) -> None:
        """Queues a command without waiting (the commands socket has no high-water mark)."""
        self._commands.send(encode(message), zmq.NOBLOCK)

    def check_loop(self, *, stopping: bool = False) -> None:
        """Raises RuntimeError unless called on the event loop that started the core: only its tasks read
        the core's results, so a request sent from another loop (a second `asyncio.run`) waited forever.
        `stopping`: any loop will do once that one has closed (`shutdown`)."""
        if self._loop is None or self._loop is asyncio.get_running_loop():
            return
        if self._loop.is_closed():
            if stopping:
                return
            raise RuntimeError(
                "the event loop that started this engine has closed (an asyncio.run that returned?): "
                "start, use and shut down an engine on one event loop"
            )
        raise RuntimeError("this engine was started on another event loop: use it from that loop")

    async def shutdown(self, timeout: float = CORE_EXIT_TIMEOUT_S) -> None:
        """Asks the core to exit, kills it after `timeout`, and releases the sockets. From another loop
        than `start`'s only once that one has closed: its tasks and its watch of the core went with it, so
        the core's exit is waited for in a thread."""
        self.check_loop(stopping=True)
        self._closing = True
        orphaned = self._loop is not None and self._loop.is_closed()
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(zmq.ZMQError):
                self.send(Shutdown())
            if not await self._exited(timeout, orphaned):
                self.kill()
                await self._exited(None, orphaned)
        if not orphaned:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._release()

    async def _exited(self, timeout: float | None, orphaned: bool) -> bool:
        """Whether the core exited within `timeout` (None: however long it takes)."""
        if orphaned:
            return await asyncio.to_thread(self.process.join, timeout) is not None
        try:
            await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _release(self) -> None:
        """Closes the sockets and removes their directory (once; a failed start already did)."""
        self._stop_reading()
        if self._context.closed:
            return
        self._sockets_closer()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    async def _wait_ready(self) -> CoreReady:
        receive = asyncio.ensure_future(self._next_result())
        exited = asyncio.ensure_future(self.process.wait())
        try:
            await asyncio.wait((receive, exited), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the load cancelled (SIGTERM): asyncio logged the tasks left pending
            receive.cancel()
            exited.cancel()
            raise
        if not receive.done():
            receive.cancel()
            raise EngineDeadError(f"the engine core exited while loading ({_exit_reason(exited.result())})")
        exited.cancel()
        message = decode_core_message(receive.result())
        if isinstance(message, CoreReady):
            return message
        self.kill()
        error = message.error if isinstance(message, CoreFailed) else f"unexpected {message!r}"
        raise EngineDeadError(error)

    async def _next_result(self) -> bytes:
        """The core's next message. zmq's fd says that the socket's state may have changed, not that a
        message waits, and it may not signal again for messages already queued: so the socket is read
        until it has none (and its events rechecked) before the fd is awaited again."""
        assert self._results_readable is not None, "start() first"
        while True:
            try:
                return self._results.recv(zmq.NOBLOCK)
            except zmq.Again:
                pass
            self._results_readable.clear()
            if not self._results.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await self._results_readable.wait()

    def _stop_reading(self) -> None:
        if self._results_readable is not None:
            if not self._loop.is_closed():  # a closed loop forgot its readers
                self._loop.remove_reader(self._results.FD)
            self._results_readable = None

    async def _receive(self, on_message: Callable[[CoreMessage], None]) -> None:
        while True:
            message = decode_core_message(await self._next_result())
            self._last_heard = time.monotonic()
            if isinstance(message, CoreFailed):
                self._dead(message.error)
                return
            if isinstance(message, CoreBusy):
                self._log_long_step(message.step_seconds)
                continue
            try:
                on_message(message)
            except Exception as exc:  # a bug in handling one: fail now, saying why, not silent until timeout
                logger.exception("handling the engine core's message failed")
                self._dead(f"handling the engine core's message failed: {type(exc).__name__}: {exc}")
                return

    def _log_long_step(self, step_seconds: float) -> None:
        """Logs once a step that has run past `timeout_seconds`: busy, so not counted as a hang."""
        if step_seconds > self.timeout_seconds and not self._long_step_logged:
            logger.warning(
                "an engine step has run %.1f s, past the engine timeout (%.1f s); the core is busy on the "
                "CPU, not hung (a smaller --max-num-batched-tokens makes steps shorter)",
                step_seconds,
                self.timeout_seconds,
            )
        self._long_step_logged = step_seconds > self.timeout_seconds

    async def _watch_exit(self) -> None:
        returncode = await self.process.wait()
        # A CoreFailed sent just before exiting says more than the exit code: let it arrive first.
        await asyncio.sleep(0.05)
        self._dead(f"the engine core process exited ({_exit_reason(returncode)})")

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, self.timeout_seconds / 4))
            silent = time.monotonic() - self._last_heard
            if silent > self.timeout_seconds:
                self._dead(f"the engine core stopped answering ({silent:.1f}s without a message)")
                return

    def _dead(self, reason: str) -> None:
        if self._on_dead is None or self._closing:
            return
        on_dead, self._on_dead = self._on_dead, None
        logger.error("engine core failed: %s", reason)
        self.kill()
        on_dead(reason)


def _close_sockets(context: zmq.Context, sockets: tuple[zmq.Socket, ...]) -> None:
    for socket in sockets:
        socket.close(linger=0)
    context.term()


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"
