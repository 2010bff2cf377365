"""`sluice serve` as a real process: ready line, `sluice generate`, and SIGTERM to its process group draining
to exit code 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_harness import PATIENCE_S, UNENDING, wait_for

from sluice import Client, generate_request
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

SLUICE = str(Path(sys.executable).parent / "sluice")
GRACE_PERIOD = 30.0  # far more than the in-flight request needs, on any machine


def test_sigterm_to_the_process_group_drains_in_flight_requests_and_exits_zero(
    llama_long_dir: str, tmp_path: Path
) -> None:
    stderr = (tmp_path / "serve.log").open("w")
    command = [SLUICE, "serve", "--model", llama_long_dir, "--host", "127.0.0.1", "--port", "0"]
    # One sequence at a time and a model with a long context: a request waits behind one that runs until
    # the test cancels it, so it is surely in flight when SIGTERM comes.
    command += ["--grace-period", str(GRACE_PERIOD), "--attention-backend", "torch", "--max-num-seqs", "1"]
    command += ["--kv-cache-memory", "80MiB", "--metrics-port", "0"]
    # A process group of its own, signalled whole below: as systemd's default KillMode, `kill -TERM -PGID`
    # and Ctrl-C in a terminal do, SIGTERM reaches the engine core too, which must leave it to the server.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
    )
    try:
        ready = process.stdout.readline()
        match = re.fullmatch(r"sluice ready: model=\S+ port=(\d+) metrics_port=(\d+) core_pid=\d+\n", ready)
        assert match, f"unexpected ready line {ready!r}; log: {(tmp_path / 'serve.log').read_text()}"
        target = f"127.0.0.1:{match.group(1)}"

        generated = subprocess.run(
            [SLUICE, "generate", "--target", target, "--max-tokens", "5", "--temperature", "0", "Hello"],
            capture_output=True,
            text=True,
            timeout=PATIENCE_S,
        )
        assert generated.returncode == 0, generated.stderr
        assert generated.stdout.endswith("\n")
        assert re.search(r"^5 tokens in [\d.]+s: [\d.]+ tokens/s, TTFT \d+ ms$", generated.stderr, re.M)

        with Client(target) as client, grpc.insecure_channel(target) as channel:
            holder = client.generate(generate_request("Hold", **UNENDING))
            next(holder)
            request = generate_request("Hello", temperature=0.0, max_tokens=80, ignore_eos=True)
            in_flight = pb_grpc.InferenceServiceStub(channel).Generate(request)  # starts at once
            metrics = f"http://127.0.0.1:{match.group(2)}/metrics"
            wait_for(lambda: _num_waiting(metrics) == 1, "the request waiting behind the holder")
            os.killpg(process.pid, signal.SIGTERM)
            holder.close()  # cancels the holder: the waiting request runs
            received = list(in_flight)
        assert received[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in received) == 80
        assert process.wait(timeout=GRACE_PERIOD + PATIENCE_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr.close()


def _num_waiting(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    families = text_string_to_metric_families(text)
    return next(s.value for f in families for s in f.samples if s.name == "sluice_num_requests_waiting")
