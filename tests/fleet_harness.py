"""Real processes for fleet tests: `sluice serve` workers and the SMG gateway (`smg launch`, PyPI `smg`,
the `fleet` extra) in front of them, all on loopback.

Nothing here sleeps for a machine-sized time: start-up waits on the ready line and on the gateway's
own /workers and /v1/models answers; timeouts only catch hangs.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

BIN = Path(sys.executable).parent
READY = re.compile(r"sluice ready: model=(\S+) port=(\d+) metrics_port=(\d+) core_pid=(\d+)\n")
START_TIMEOUT_S = 300.0


def wait_for(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SluiceProcess:
    """`sluice serve` on 127.0.0.1 with a free gRPC port and a /metrics port."""

    def __init__(self, model_dir: str, log: Path, *, grace_period: float = 10.0, extra: Sequence[str] = ()):
        self.log_path = log
        self._log = log.open("w")
        command = [str(BIN / "sluice"), "serve", "--model", model_dir, "--host", "127.0.0.1", "--port", "0"]
        command += ["--metrics-port", "0", "--grace-period", str(grace_period)]
        command += ["--attention-backend", "torch", "--kv-cache-memory", "8MiB", *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True)
        ready = self.process.stdout.readline()
        match = READY.fullmatch(ready)
        assert match, f"unexpected ready line {ready!r}; log: {log.read_text()}"
        self.model = match.group(1)
        self.port, self.metrics_port = int(match.group(2)), int(match.group(3))
        self.core_pid = int(match.group(4))  # the engine core process

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read()
        return [
            (sample.labels, sample.value)
            for family in text_string_to_metric_families(text.decode())
            for sample in family.samples
            if sample.name == name
        ]

    def rpc_count(self, method: str, code: str | None = "OK") -> float:
        """Calls of `method` (e.g. "VllmEngine.Generate") that ended with `code` (None: with any)."""
        return sum(
            value
            for labels, value in self.samples("sluice_rpc_requests_total")
            if labels["method"] == method and code in (None, labels["code"])
        )

    def finished(self, finish_reason: str | None = None) -> float:
        """sluice_requests_total, over tenants (and finish reasons unless one is given)."""
        return sum(
            value
            for labels, value in self.samples("sluice_requests_total")
            if finish_reason is None or labels["finish_reason"] == finish_reason
        )

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        self.kill()
        self.process.stdout.close()
        self._log.close()


class SmgGateway:
    """`smg launch` on loopback in front of gRPC workers, with health checks every second (a worker is
    dropped at its first failed check) and retries of failed calls on other workers."""

    def __init__(
        self, worker_urls: Sequence[str], log: Path, *, policy: str = "cache_aware", extra: Sequence[str] = ()
    ) -> None:
        self.port = free_port()
        self.log_path = log
        self._log = log.open("w")
        command = [str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--worker-urls", *worker_urls, "--policy", policy]
        command += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
        command += ["--health-success-threshold", "1", "--health-check-timeout-secs", "5"]
        command += ["--retry-max-retries", "10", "--retry-initial-backoff-ms", "50"]
        command += ["--retry-max-backoff-ms", "1000", "--prometheus-host", "127.0.0.1"]
        self.metrics_port = free_port()
        command += ["--prometheus-port", str(self.metrics_port), "--log-level", "warn", *extra]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self.num_workers = len(worker_urls)
        wait_for(self._ready, START_TIMEOUT_S, f"SMG to register {self.num_workers} healthy workers", 0.2)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def get(self, path: str) -> object:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as response:
            return json.loads(response.read())

    def workers(self) -> dict[str, bool]:
        """Each registered worker's URL and whether SMG holds it healthy."""
        listed = self.get("/workers")
        return {w["url"]: bool(w.get("is_healthy", w.get("healthy"))) for w in listed["workers"]}

    def models(self) -> list[str]:
        return [model["id"] for model in self.get("/v1/models")["data"]]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the gateway's Prometheus samples `name` whose labels include `labels`."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text.decode())
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def _ready(self) -> bool:
        assert self.process.poll() is None, f"smg exited; log: {self.log_path.read_text()[-3000:]}"
        try:
            workers = self.workers()
            return len(workers) == self.num_workers and all(workers.values()) and bool(self.models())
        except (OSError, urllib.error.URLError, KeyError, ValueError):
            return False

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
