"""A `sluice serve` subprocess on a loopback port, for benchmarks that need a real server to drive."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO

_READY = "sluice ready:"


class ServerProcess:
    """Starts `python -m sluice.service.cli serve --host 127.0.0.1 --port 0 ARGS` and waits for its ready
    line.

    Used as a context manager; leaving it sends SIGTERM (the server drains) and waits for the exit.
    """

    def __init__(
        self,
        serve_args: Sequence[str],
        *,
        startup_timeout: float = 300.0,
        env: Mapping[str, str] | None = None,
        stderr: IO[str] | int = subprocess.DEVNULL,
    ) -> None:
        command = [sys.executable, "-m", "sluice.service.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
        self.process = subprocess.Popen(
            [*command, *serve_args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.ready_fields = self._wait_ready(startup_timeout)
        self.port = int(self.ready_fields["port"])
        self.core_pid = int(self.ready_fields["core_pid"])

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        assert self.process.stdout is not None
        for line in self.process.stdout:  # "sluice ready: model=NAME port=PORT ... core_pid=PID"
            if line.startswith(_READY):
                return dict(part.split("=", 1) for part in line.split()[2:] if "=" in part)
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError(f"sluice serve exited or did not get ready (exit code {self.process.poll()})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
