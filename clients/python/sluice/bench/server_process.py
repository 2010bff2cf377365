"""A `sluice serve` subprocess on a loopback port, for benchmarks that need a real server to drive."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence

_READY = "sluice ready:"


class ServerProcess:
    """Starts `python -m service.cli serve --host 127.0.0.1 --port 0 ARGS` and waits for its ready line.

    Used as a context manager; leaving it sends SIGTERM (the server drains) and waits for the exit.
    """

    def __init__(self, serve_args: Sequence[str], *, startup_timeout: float = 300.0) -> None:
        command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
        self._process = subprocess.Popen(
            [*command, *serve_args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self.port = self._wait_ready(startup_timeout)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        assert self._process.stdout is not None
        for line in self._process.stdout:  # "sluice ready: model=NAME port=PORT ..."
            if line.startswith(_READY):
                fields = dict(part.split("=", 1) for part in line.split()[2:] if "=" in part)
                return int(fields["port"])
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError(f"sluice serve exited or did not get ready (exit code {self._process.poll()})")

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
