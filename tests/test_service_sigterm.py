"""`sluice serve` as a real process: ready line, `sluice generate`, and SIGTERM draining to exit code 0."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sluice import Client, generate_request
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(120)

SLUICE = str(Path(sys.executable).parent / "sluice")
GRACE_PERIOD = 10.0


def test_sigterm_drains_in_flight_requests_and_exits_zero(llama_dir: str, tmp_path: Path) -> None:
    stderr = (tmp_path / "serve.log").open("w")
    command = [SLUICE, "serve", "--model", llama_dir, "--host", "127.0.0.1", "--port", "0"]
    command += [
        "--grace-period",
        str(GRACE_PERIOD),
        "--attention-backend",
        "torch",
        "--kv-cache-memory",
        "8MiB",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        ready = process.stdout.readline()
        match = re.fullmatch(r"sluice ready: model=\S+ port=(\d+) core_pid=\d+\n", ready)
        assert match, f"unexpected ready line {ready!r}; log: {(tmp_path / 'serve.log').read_text()}"
        target = f"127.0.0.1:{match.group(1)}"

        generated = subprocess.run(
            [SLUICE, "generate", "--target", target, "--max-tokens", "5", "--temperature", "0", "Hello"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert generated.returncode == 0, generated.stderr
        assert generated.stdout.endswith("\n")
        assert re.search(r"^5 tokens in [\d.]+s: [\d.]+ tokens/s, TTFT \d+ ms$", generated.stderr, re.M)

        with Client(target) as client:
            chunks = client.generate(
                generate_request("Hello", temperature=0.0, max_tokens=80, ignore_eos=True)
            )
            received = [next(chunks)]
            process.send_signal(signal.SIGTERM)
            start = time.monotonic()
            received += list(chunks)
        assert received[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in received) == 80
        assert process.wait(timeout=GRACE_PERIOD + 5) == 0
        assert time.monotonic() - start < GRACE_PERIOD + 5
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr.close()
