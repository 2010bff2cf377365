"""ChildProcess, how the frontend starts its engine core: exit codes reach the loop, a kill is seen, and no
Python fork handling runs in the server's process (uvloop's own spawn runs it; that is what it replaces)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import uvloop

from sluice.engine.process.child_process import ChildProcess

FORKS_SEEN: list[int] = []
os.register_at_fork(before=lambda: FORKS_SEEN.append(os.getpid()))


def test_the_exit_code_reaches_the_loop() -> None:
    async def run() -> tuple[int | None, int, int | None]:
        child = ChildProcess([sys.executable, "-c", "import sys; sys.exit(3)"])
        running = child.returncode
        return running, await child.wait(), child.returncode

    running, code, after = uvloop.run(run())
    assert running is None and code == 3 and after == 3


def test_a_killed_child_reports_the_signal_and_kill_after_exit_is_harmless() -> None:
    async def run() -> tuple[int, int]:
        child = ChildProcess([sys.executable, "-c", "import time; time.sleep(600)"])
        child.kill()
        code = await child.wait()
        child.kill()  # already reaped: nothing to do, no error
        return code, await child.wait()

    assert uvloop.run(run()) == (-signal.SIGKILL, -signal.SIGKILL)


def test_starting_a_child_runs_no_python_fork_handler_on_uvloop() -> None:
    before = len(FORKS_SEEN)

    async def child_process() -> int:
        return await ChildProcess([sys.executable, "-c", "pass"]).wait()

    assert uvloop.run(child_process()) == 0
    assert len(FORKS_SEEN) == before, "starting the core ran Python's before-fork handlers"

    # The check can fail: the loop's own spawn (what ChildProcess replaces) runs them.
    async def loop_spawn() -> int:
        return await (await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")).wait()

    assert uvloop.run(loop_spawn()) == 0
    assert len(FORKS_SEEN) > before, (
        "uvloop's own spawn no longer runs Python's fork handlers: child_process.py's reason is gone"
    )
