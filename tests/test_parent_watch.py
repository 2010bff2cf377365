"""`ParentWatch` ends a process busy in work that cannot look for its parent (loading a model) once that
parent is killed: through a pidfd, or by polling `os.getppid()` where there is none. Real processes: a
middle one, killed with SIGKILL, whose child is inside the watch."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import process_running
from service_harness import PATIENCE_S

# The child: inside the watch, waits forever; its watch writes the marker and ends it.
_CHILD = """
import os, sys, threading
from pathlib import Path
from sluice.engine import parent_watch
if sys.argv[2] == "poll":
    parent_watch._pidfd = lambda pid: None
marker = Path(sys.argv[1])
with parent_watch.ParentWatch(os.getppid(), lambda: marker.write_text("gone"), "the test waited"):
    print(os.getpid(), flush=True)
    threading.Event().wait()
sys.exit(3)
"""

# The middle process: starts the child (which prints its pid to the shared stdout) and waits forever.
_MIDDLE = """
import subprocess, sys, threading
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
threading.Event().wait()
"""


@pytest.mark.parametrize("how", ["pidfd", "poll"])
def test_a_child_in_the_watch_ends_once_its_parent_is_killed(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "marker"
    middle = subprocess.Popen(
        [sys.executable, "-c", _MIDDLE, _CHILD, str(marker), how], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(middle.stdout.readline())  # printed inside the watch
        assert process_running(child) and not marker.exists()
        middle.send_signal(signal.SIGKILL)
        middle.wait()
        deadline = time.monotonic() + PATIENCE_S
        while process_running(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.02)
        assert marker.read_text() == "gone"
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait()
