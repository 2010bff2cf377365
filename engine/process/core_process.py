"""The engine core's own process: `python -m sluice.engine.process.core_process --commands ADDR --results
ADDR --parent-pid PID`.

Started by `sluice.engine.frontend.core_client.CoreClient`. It receives a `CoreConfig`, loads the model,
answers `CoreReady` (or `CoreFailed`), then loops:

    apply every queued command (waiting up to a heartbeat when idle)
    step while there is work, sending one `CoreOutputs` per step (every request's new tokens, and stats)
    (a step that runs long on the CPU: `CoreBusy` every heartbeat while it works, from `StepWatch`)

It exits 0 on `Shutdown` or when its parent process is gone (while it loads too: `ParentWatch`), and 1
after telling the frontend why it failed (`CoreFailed`) when loading or a step raises. Only this process
imports torch.

It ignores SIGTERM and SIGINT: sent to the whole process group (systemd's default KillMode, `kill -TERM
-PGID`, Ctrl-C in a terminal) they reach it beside the frontend, which drains its requests through this
process first and then stops it. The tensor-parallel workers it spawns inherit the ignored signals.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import zmq

from sluice.engine.core.engine_core import EngineCore
from sluice.engine.errors import InvalidRequestError
from sluice.engine.messages import (
    SOCKET_DIRECTORY_PREFIX,
    AbortRequests,
    AddRequest,
    CoreConfig,
    CoreFailed,
    CoreHeartbeat,
    CoreOutput,
    CoreOutputs,
    CoreReady,
    Shutdown,
    StartProfile,
    StopProfile,
    decode_frontend_message,
    encode,
)
from sluice.engine.parent_watch import ParentWatch
from sluice.engine.process.host_memory import freeze_gc_heap, retain_freed_memory
from sluice.engine.process.step_watch import StepWatch
from sluice.engine.process.threads import configure_torch_threads
from sluice.engine.worker.model_runner import pick_device

logger = logging.getLogger("sluice.engine_core")


class CoreLoop:
    """Feeds commands to an `EngineCore` and sends back what each step produced."""

    def __init__(
        self,
        core: EngineCore,
        commands: zmq.Socket,
        results: zmq.Socket,
        heartbeat: float,
        parent_pid: int,
        step_watch: StepWatch | None = None,
    ) -> None:
        self.core = core
        self.commands = commands
        self.results = results
        self.heartbeat_ms = int(heartbeat * 1000)
        self.parent_pid = parent_pid  # the frontend, read when the process started (it may be gone by now)
        self._stepping = contextlib.nullcontext if step_watch is None else step_watch.step

    def run(self) -> int:
        """Returns the process exit code."""
        while True:
            if os.getppid() != self.parent_pid:
                return 0  # the frontend is gone (no signal stops this process: see the module's docstring)
            if not self.core.has_work() and not self.commands.poll(self.heartbeat_ms):
                self.results.send(encode(CoreHeartbeat(self.core.stats())))
                continue
            outputs = self._apply_commands()
            if outputs is None:
                return 0
            try:
                with self._stepping():
                    outputs += self.core.step()
            except Exception as exc:
                logger.exception("engine step failed")
                self.results.send(encode(CoreFailed(f"a step raised {type(exc).__name__}: {exc}")))
                return 1
            self.results.send(encode(CoreOutputs(outputs, self.core.stats(), self.core.take_kv_events())))

    def _apply_commands(self) -> list[CoreOutput] | None:
        """Applies every queued command; returns the outputs of aborted requests (None: shut down)."""
        outputs: list[CoreOutput] = []
        while True:
            try:
                message = decode_frontend_message(self.commands.recv(zmq.NOBLOCK))
            except zmq.Again:
                return outputs
            if isinstance(message, Shutdown):
                return None
            if isinstance(message, AbortRequests):
                errors = dict.fromkeys(message.request_ids, message.error) if message.error else None
                outputs += self.core.abort(message.request_ids, errors)
            elif isinstance(message, StartProfile):
                self.core.start_profile(message)
            elif isinstance(message, StopProfile):
                self.core.stop_profile()
            elif isinstance(message, AddRequest):
                try:
                    self.core.add_request(message)
                except InvalidRequestError as exc:  # e.g. needs more KV blocks than the cache has
                    outputs.append(CoreOutput.refused(message.request_id, exc))
                except Exception as exc:  # a request the frontend should have refused fails alone
                    logger.exception("adding request %s failed", message.request_id)
                    outputs.append(
                        CoreOutput.failed(message.request_id, f"the engine could not take it: {exc}")
                    )


def serve_core(commands_address: str, results_address: str, parent_pid: int) -> int:
    """`parent_pid`: the frontend's, from its command line (it may have ended before this process began)."""
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.bind(commands_address)
    results = context.socket(zmq.PUSH)
    results.setsockopt(zmq.SNDHWM, 0)
    results.connect(results_address)
    try:
        with ParentWatch(parent_pid, lambda: _remove_socket_directory(commands_address), "the model loaded"):
            setup = decode_frontend_message(commands.recv())
            assert isinstance(setup, CoreConfig), f"expected CoreConfig first, got {type(setup).__name__}"
            configure_torch_threads(setup.config.num_threads)
            core = EngineCore(setup.config)
            if setup.kv_events:
                core.record_kv_events()
            # After loading, whose big temporaries (weights on their way to the device) go back to the OS.
            retain_freed_memory()
            frozen = freeze_gc_heap()
    except Exception as exc:
        if isinstance(exc, ValueError | OSError):  # what the user gave (a flag, a path, a file): no traceback
            logger.error("loading the engine core failed: %s: %s", type(exc).__name__, exc)
            logger.debug("loading the engine core failed", exc_info=True)
        else:
            logger.exception("loading the engine core failed")
        results.send(encode(CoreFailed(f"loading the model failed: {type(exc).__name__}: {exc}")))
        return 1
    logger.info(
        "engine core ready (pid %d, %d torch threads, %d objects frozen, %s scheduling)",
        os.getpid(),
        torch.get_num_threads(),  # rank 0 of a tensor-parallel group: its share, set by the executor
        frozen,
        "async" if core.async_scheduling else "synchronous",
    )
    tokenizer = None if core.tokenizer is None else core.tokenizer.spec()
    results.send(encode(CoreReady(core.model_info, tokenizer, os.getpid())))
    # A long CPU step keeps telling the frontend it is busy (see StepWatch for why not on a GPU).
    on_cpu = pick_device(setup.config.model.device).type == "cpu"
    watch = StepWatch(context, results_address, setup.heartbeat_seconds) if on_cpu else None
    try:
        return CoreLoop(core, commands, results, setup.heartbeat_seconds, parent_pid, watch).run()
    finally:
        if watch is not None:
            watch.close()
        results.close(linger=1000)  # let the last message (e.g. CoreFailed) go out
        commands.close(linger=0)
        context.term()
        if os.getppid() != parent_pid:  # the frontend died (SIGKILL, OOM): nobody else removes its sockets
            _remove_socket_directory(commands_address)


def _remove_socket_directory(address: str) -> None:
    """The frontend's directory of the `ipc://` sockets (`CoreClient`), with them."""
    directory = Path(address.removeprefix("ipc://")).parent
    if directory.name.startswith(SOCKET_DIRECTORY_PREFIX):
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.engine.process.core_process", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--commands", required=True, help="ZeroMQ address to pull commands from")
    parser.add_argument("--results", required=True, help="ZeroMQ address to push results to")
    parser.add_argument("--parent-pid", type=int, required=True, help="the frontend's; exit when it ends")
    args = parser.parse_args(argv)
    for stop_signal in (signal.SIGTERM, signal.SIGINT):  # the frontend stops this process (docstring)
        signal.signal(stop_signal, signal.SIG_IGN)
    faulthandler.enable()  # a crash in native code (torch, a C++ kernel) prints every thread's Python stack
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve_core(args.commands, args.results, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
