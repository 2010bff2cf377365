"""`sluice serve` whose stdout nobody reads any more (the pipe's reader gone, as when a log shipper died)
keeps serving: its ready line goes to the log instead. It used to die at that line with a BrokenPipeError
traceback, a ready server lost to a print."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from service_harness import PATIENCE_S, wait_for

from sluice import generate_request
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)

SLUICE = str(Path(sys.executable).parent / "sluice")
READY = re.compile(r"sluice ready: model=\S+ port=(\d+) core_pid=\d+")


def test_a_server_whose_stdout_reader_is_gone_serves_and_logs_its_ready_line(
    llama_dir: str, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    command = [SLUICE, "serve", "--model", llama_dir, "--host", "127.0.0.1", "--port", "0"]
    command += ["--attention-backend", "torch", "--kv-cache-memory", "16MiB"]
    with log.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr)
    process.stdout.close()  # the reader goes before the server is ready: its ready line meets EPIPE
    try:
        wait_for(lambda: READY.search(log.read_text()) or process.poll() is not None, "the ready line")
        assert process.poll() is None, f"the server exited {process.returncode}: {log.read_text()}"
        port = READY.search(log.read_text()).group(1)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            request = generate_request("Still there?", max_tokens=3, ignore_eos=True)
            chunks = list(stub.Generate(request, timeout=PATIENCE_S))
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(chunk.token_ids) for chunk in chunks) == 3
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=PATIENCE_S) == 0, log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
