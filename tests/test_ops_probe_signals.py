"""`sluice serve` signalled again while it drains: a second SIGINT (Ctrl-C again) ends the grace period at
once, aborting what still runs, and the process exits 0; a repeated SIGTERM (a supervisor may deliver one
twice) leaves the drain as it was."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from service_harness import PATIENCE_S, UNENDING, wait_for

from sluice import generate_request
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)

SLUICE = str(Path(sys.executable).parent / "sluice")
GRACE_PERIOD = 3600.0  # outlasts the test: the request ends only if the grace period is cut short


class Stream(threading.Thread):
    """Reads one UNENDING Generate stream to its end, keeping its chunks."""

    def __init__(self, target: str) -> None:
        super().__init__(daemon=True)
        self._channel = grpc.insecure_channel(target)
        request = generate_request("Hold", **UNENDING)
        self._call = pb_grpc.InferenceServiceStub(self._channel).Generate(request)
        self.chunks: list[pb.GenerateResponse] = []
        self.code: grpc.StatusCode | None = None

    def run(self) -> None:
        try:
            for chunk in self._call:
                self.chunks.append(chunk)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code = error.code()
        finally:
            self._channel.close()


@contextlib.contextmanager
def draining_server(model_dir: str, log: Path) -> Iterator[tuple[subprocess.Popen[str], Stream]]:
    """A `sluice serve` process draining (SIGTERM sent, its log says so) with one request running."""
    command = [SLUICE, "serve", "--model", model_dir, "--host", "127.0.0.1", "--port", "0"]
    command += ["--grace-period", str(GRACE_PERIOD), "--attention-backend", "torch"]
    command += ["--kv-cache-memory", "80MiB"]
    with log.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        ready = process.stdout.readline()
        match = re.fullmatch(r"sluice ready: model=\S+ port=(\d+) core_pid=\d+\n", ready)
        assert match, f"unexpected ready line {ready!r}; log: {log.read_text()}"
        stream = Stream(f"127.0.0.1:{match.group(1)}")
        stream.start()
        wait_for(lambda: stream.chunks, "the stream's first chunk")
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining: NOT_SERVING" in log.read_text(), "the drain")
        yield process, stream
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_second_sigint_aborts_the_requests_still_running_and_exits_zero(
    llama_long_dir: str, tmp_path: Path
) -> None:
    """It was ignored: Ctrl-C again left the server waiting out the whole grace period (30 s by default)."""
    log = tmp_path / "serve.log"
    with draining_server(llama_long_dir, log) as (process, stream):
        process.send_signal(signal.SIGINT)
        stream.join(PATIENCE_S)
        assert stream.code == grpc.StatusCode.OK
        assert stream.chunks[-1].finish_reason == pb.FINISH_REASON_ABORT
        assert process.wait(PATIENCE_S) == 0
    assert "SIGINT again: the grace period ends now" in log.read_text()


def test_a_second_sigterm_leaves_the_requests_their_grace_period(llama_long_dir: str, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with draining_server(llama_long_dir, log) as (process, stream):
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: "SIGTERM again: the drain goes on" in log.read_text(), "the second SIGTERM")
        num_chunks = len(stream.chunks)
        wait_for(lambda: len(stream.chunks) > num_chunks, "a chunk after the second SIGTERM")
        assert stream.code is None and process.poll() is None
