"""Rollouts and scale-out with real servers on loopback and the documented client service config
(sluice.service_config: round_robin, health checking, UNAVAILABLE retried):

- a `sluice serve` process drained by SIGTERM while a client keeps calling: the client sees zero failed
  calls, the second server takes the traffic, the drained one exits 0;
- a server added behind the same DNS name gets traffic from an already-connected client within
  max_connection_age + grace (the first server's GOAWAY makes the client re-resolve).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from fake_dns import FakeDns
from prometheus_client.parser import text_string_to_metric_families
from service_harness import PATIENCE_S, ServerThread, tiny_engine_config, wait_for

from sluice import Client, SluiceError, generate_request
from sluice.service.server import ServerConfig
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(180)

SLUICE = str(Path(sys.executable).parent / "sluice")
GRACE_PERIOD = 30.0  # far more than the calls in flight need, on any machine
READY = re.compile(r"sluice ready: model=\S+ port=(\d+) metrics_port=(\d+) core_pid=\d+\n")


class ServeProcess:
    """`sluice serve` on 127.0.0.1 with a free gRPC port and a /metrics port."""

    def __init__(self, llama_dir: str, log: Path) -> None:
        self._log = log.open("w")
        command = [SLUICE, "serve", "--model", llama_dir, "--host", "127.0.0.1", "--port", "0"]
        command += ["--metrics-port", "0", "--grace-period", str(GRACE_PERIOD)]
        command += ["--attention-backend", "torch", "--kv-cache-memory", "8MiB"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True)
        ready = self.process.stdout.readline()
        match = READY.fullmatch(ready)
        assert match, f"unexpected ready line {ready!r}; log: {log.read_text()}"
        self.port, self.metrics_port = int(match.group(1)), int(match.group(2))

    def finished_requests(self) -> float:
        """sluice_requests_total summed over finish reasons and tenants, from /metrics."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "sluice_requests_total"
        )

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()


class CallLoop:
    """`num_threads` threads calling Generate in a loop through one client; records every failure."""

    def __init__(self, client: Client, num_threads: int) -> None:
        self._client = client
        self._stop = threading.Event()
        self.failures: list[str] = []
        self.completed: list[tuple[float, int]] = []  # (finish time, completion tokens)
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        # Thread 0 runs long requests, so some are in flight on the draining server.
        max_tokens = 100 if index == 0 else 6
        request = generate_request(f"Hello {index}", temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        while not self._stop.is_set():
            try:
                completion = self._client.complete(request, timeout=60)
            except SluiceError as exc:
                self.failures.append(f"{exc.code.name}: {exc.message}")
                continue
            if completion.finish_reason != pb.FINISH_REASON_LENGTH:
                self.failures.append(f"finish_reason {completion.finish_reason_name}")
            self.completed.append((time.monotonic(), completion.usage.completion_tokens))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)


def test_sigterm_drain_loses_no_call_while_the_other_server_takes_over(
    llama_dir: str, tmp_path: Path
) -> None:
    first = ServeProcess(llama_dir, tmp_path / "first.log")
    second = ServeProcess(llama_dir, tmp_path / "second.log")
    try:
        target = f"ipv4:127.0.0.1:{first.port},127.0.0.1:{second.port}"
        with Client(target) as client:
            assert client.model_info(timeout=30).vocab_size == 512  # channel up
            calls = CallLoop(client, num_threads=4)
            try:
                wait_for(
                    lambda: first.finished_requests() >= 2 and second.finished_requests() >= 2,
                    "round robin reaching both servers",
                )
                first.process.send_signal(signal.SIGTERM)
                assert first.process.wait(timeout=GRACE_PERIOD + PATIENCE_S) == 0
                second_at_exit = second.finished_requests()
                first_gone = time.monotonic()
                # Calls go on against the second server alone.
                wait_for(lambda: _num_after(calls, first_gone) >= 5, "5 calls after the first server exited")
            finally:
                calls.stop()
        assert calls.failures == []
        after_exit = [tokens for finished, tokens in calls.completed if finished > first_gone]
        assert len(after_exit) >= 5 and all(tokens in (6, 100) for tokens in after_exit)
        # Only the second server can have served them; up to one call a thread (4) may have finished there
        # before `second_at_exit` was read and reached its client after `first_gone`.
        assert second.finished_requests() >= second_at_exit + len(after_exit) - 4
    finally:
        first.close()
        second.close()


def _num_after(calls: CallLoop, since: float) -> int:
    return sum(finished > since for finished, _ in list(calls.completed))


MAX_CONNECTION_AGE = 1.5
MAX_CONNECTION_AGE_GRACE = 1.0


def test_a_server_added_behind_the_name_gets_traffic_within_max_connection_age(llama_dir: str) -> None:
    aged = ServerConfig(
        host="127.0.0.1",
        port=0,
        max_connection_age=MAX_CONNECTION_AGE,
        max_connection_age_grace=MAX_CONNECTION_AGE_GRACE,
    )
    first = ServerThread(tiny_engine_config(llama_dir), aged).start()
    dns = FakeDns("sluice.test", ["127.0.0.1"])
    second = None
    try:
        port = first.server.port
        # Re-resolution may follow a GOAWAY at once (grpc's default spaces resolutions 30 s apart).
        options = [("grpc.dns_min_time_between_resolutions_ms", 100)]
        with Client(dns.target(port), options=options) as client:
            request = generate_request("Hi", temperature=0.0, max_tokens=2, ignore_eos=True)
            for _ in range(3):
                assert client.complete(request, timeout=30).usage.completion_tokens == 2
            # The new replica: same port on another loopback address, then in the DNS answer.
            second_config = ServerConfig(host="127.0.0.2", port=port)
            second = ServerThread(tiny_engine_config(llama_dir), second_config).start()
            dns.addresses.append("127.0.0.2")
            added = time.monotonic()
            served_by_second = 0.0
            while served_by_second == 0:
                elapsed = time.monotonic() - added
                # Due after max_connection_age (+-10% jitter) + grace and a reconnect; without the
                # server's max_connection_age the client would never re-resolve (grpc re-resolves on a
                # lost connection), so a bound 10x larger still fails then and never on a slow machine.
                assert elapsed < 10 * (MAX_CONNECTION_AGE * 1.1 + MAX_CONNECTION_AGE_GRACE), (
                    f"no call reached the new server in {elapsed:.1f}s"
                )
                assert client.complete(request, timeout=30).usage.completion_tokens == 2
                served_by_second = _generate_calls(second)
            # From now on round robin spreads calls over both. (Not within a fixed number of calls: while
            # the first server's connection is being replaced at its max_connection_age, every call goes
            # to the second.)
            before = (_generate_calls(first), _generate_calls(second))
            for _ in range(200):
                client.complete(request, timeout=30)
                after = (_generate_calls(first), _generate_calls(second))
                if after[0] > before[0] and after[1] > before[1]:
                    break
            assert after[0] > before[0] and after[1] > before[1], (before, after)
    finally:
        dns.close()
        first.stop()
        if second is not None:
            second.stop()


def _generate_calls(server: ServerThread) -> float:
    labels = {"method": "Generate", "code": "OK"}
    return server.server.metrics.registry.get_sample_value("sluice_rpc_requests_total", labels) or 0.0
