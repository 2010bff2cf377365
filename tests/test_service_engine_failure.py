"""A dead engine is a failed pod: real `sluice serve` processes, real engine core processes, loopback.

SIGKILL of the core, or a step that raises: health goes NOT_SERVING, every running stream ends
UNAVAILABLE and `sluice serve` exits non-zero, all told by the core's exit (the servers run with
--engine-timeout 3600, so the core's silence never counts within a test; no wall-clock bound is asserted).
A request whose detokenization raises ends alone with INTERNAL. A slow reader gets merged chunks. The
frontend process never loads torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from service_harness import PATIENCE_S, UNENDING_TOKENS, wait_for

from sluice.benchmarks.serving.server_process import ServerProcess
from sluice.engine.faults import ENV_VAR as FAULT_VAR
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)

NUM_STREAMS = 16
PROMPT = "the quick brown fox"


def _serve(
    model_dir: str, tmp_path: Path, fault: str | None = None, extra: tuple[str, ...] = ()
) -> ServerProcess:
    # 80 MiB: KV blocks for a request of UNENDING_TOKENS (64 MiB) and some (the model needs 512 B a token).
    args = ["--model", model_dir, "--attention-backend", "torch", "--kv-cache-memory", "80MiB"]
    args += ["--engine-timeout", "3600", "--metrics-port", "0", *extra]
    log = (tmp_path / "serve.log").open("w")
    return ServerProcess(args, env={FAULT_VAR: fault} if fault else {}, stderr=log, startup_timeout=120)


def _request(request_id: str, max_tokens: int = UNENDING_TOKENS) -> pb.GenerateRequest:
    """By default a request that runs until the test ends it (the servers run the long-context model)."""
    params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, text=PROMPT, sampling_params=params)


class StreamWatcher(threading.Thread):
    """Reads one Generate stream to its end; records the chunks and how it ended."""

    def __init__(
        self, stub: pb_grpc.InferenceServiceStub, request_id: str, max_tokens: int = UNENDING_TOKENS
    ) -> None:
        super().__init__(daemon=True)
        self.started = threading.Event()
        self.chunks: list[pb.GenerateResponse] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._call = stub.Generate(_request(request_id, max_tokens))

    def run(self) -> None:
        try:
            for chunk in self._call:
                self.chunks.append(chunk)
                self.started.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code, self.details = error.code(), error.details()
        self.started.set()


def _start_streams(channel: grpc.Channel, num: int = NUM_STREAMS) -> list[StreamWatcher]:
    stub = pb_grpc.InferenceServiceStub(channel)
    watchers = [StreamWatcher(stub, f"stream-{i}") for i in range(num)]
    for watcher in watchers:
        watcher.start()
    for watcher in watchers:
        assert watcher.started.wait(PATIENCE_S), "a stream never produced a chunk"
        assert watcher.code is None, f"{watcher.code}: {watcher.details}"  # it runs until the test ends it
    return watchers


def _health(channel: grpc.Channel) -> int:
    request = health_pb2.HealthCheckRequest(service="")
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def _assert_engine_failure_ends_everything(server: ServerProcess, channel, watchers, reason) -> None:
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    wait_for(lambda: _health(channel) == not_serving, "health NOT_SERVING")
    for watcher in watchers:
        watcher.join(PATIENCE_S)
        assert watcher.code == grpc.StatusCode.UNAVAILABLE, f"{watcher.code}: {watcher.details}"
        assert "the engine failed" in watcher.details and reason in watcher.details, watcher.details
    assert server.process.wait(PATIENCE_S) != 0


def test_a_killed_engine_core_fails_every_stream_health_and_the_process(llama_long_dir, tmp_path):
    server = _serve(llama_long_dir, tmp_path)
    try:
        with grpc.insecure_channel(server.target) as channel:
            watchers = _start_streams(channel)
            os.kill(server.core_pid, signal.SIGKILL)
            _assert_engine_failure_ends_everything(server, channel, watchers, "killed by SIGKILL")
    finally:
        server.stop()


def test_a_step_that_raises_fails_every_stream_health_and_the_process(llama_long_dir, tmp_path):
    server = _serve(llama_long_dir, tmp_path, fault="step:poison")
    try:
        with grpc.insecure_channel(server.target) as channel:
            watchers = _start_streams(channel)
            poisoned = StreamWatcher(pb_grpc.InferenceServiceStub(channel), "poison-1")
            poisoned.start()
            _assert_engine_failure_ends_everything(server, channel, [*watchers, poisoned], "InjectedFault")
    finally:
        server.stop()


def test_a_core_that_dies_during_the_drain_fails_its_streams_and_the_exit(llama_long_dir, tmp_path):
    # The grace period outlasts the test: the drain is still waiting for the streams when the core dies.
    server = _serve(llama_long_dir, tmp_path, extra=("--grace-period", "3600"))
    try:
        with grpc.insecure_channel(server.target) as channel:
            watchers = _start_streams(channel, num=2)
            server.process.send_signal(signal.SIGTERM)
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            wait_for(lambda: _health(channel) == not_serving, "health NOT_SERVING (draining)")
            assert all(watcher.code is None for watcher in watchers)  # the drain lets them run
            os.kill(server.core_pid, signal.SIGKILL)
            for watcher in watchers:
                watcher.join(PATIENCE_S)
                assert watcher.code == grpc.StatusCode.UNAVAILABLE, f"{watcher.code}: {watcher.details}"
            assert server.process.wait(PATIENCE_S) == 1
    finally:
        server.stop()


def test_a_request_whose_detokenization_raises_ends_alone_with_internal(llama_long_dir, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = LLM(llama_long_dir, num_blocks=64).generate([PROMPT], params)
    server = _serve(llama_long_dir, tmp_path, fault="detokenize:bad-")
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            watchers = [StreamWatcher(stub, name, max_tokens=40) for name in ("ok-1", "bad-1", "ok-2")]
            for watcher in watchers:
                watcher.start()
            for watcher in watchers:
                watcher.join(PATIENCE_S)
            ok_1, bad, ok_2 = watchers
            assert bad.code == grpc.StatusCode.INTERNAL and "detokenization failed" in bad.details
            for ok in (ok_1, ok_2):
                assert ok.code == grpc.StatusCode.OK
                assert [t for c in ok.chunks for t in c.token_ids] == expected[0].token_ids
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()
    assert server.process.returncode == 0


def _engine_gauges(server: ServerProcess) -> tuple[float, float, float]:
    """(requests running, waiting, KV blocks used) from the server's /metrics."""
    url = f"http://127.0.0.1:{server.ready_fields['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    names = ("sluice_num_requests_running", "sluice_num_requests_waiting", "sluice_kv_cache_blocks_used")
    return tuple(values[name] for name in names)


def test_a_slow_reader_receives_fewer_merged_chunks_equal_to_the_offline_engine(llama_long_dir, tmp_path):
    """The slowest reader: after its first chunk it reads nothing until the engine has finished the
    request, so the server's writes wait on the reader's small window and the rest is merged."""
    num_tokens = 200
    expected = LLM(llama_long_dir, num_blocks=64).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    )[0]
    server = _serve(llama_long_dir, tmp_path)
    # A small HTTP/2 receive window, as a client on a slow link has: the server's writes then wait for
    # the reader instead of piling up in the client's buffers.
    options = [("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)]
    try:
        with grpc.insecure_channel(server.target, options=options) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            call = stub.Generate(_request("slow", num_tokens))
            chunks = [next(call)]
            wait_for(lambda: _engine_gauges(server) == (0, 0, 0), "the request finished in the engine")
            chunks += list(call)
        assert len(chunks) < num_tokens // 4, f"{len(chunks)} chunks: the server did not merge"
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert "".join(c.text for c in chunks) == expected.text
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        server.stop()


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_frontend_process_never_loads_torch_and_the_core_does(llama_dir, tmp_path):
    server = _serve(llama_dir, tmp_path)
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            watchers = [StreamWatcher(stub, f"stream-{i}", max_tokens=20) for i in range(2)]
            for watcher in watchers:
                watcher.start()
            for watcher in watchers:
                watcher.join(PATIENCE_S)
                assert watcher.code == grpc.StatusCode.OK
        assert _maps_torch(server.core_pid)
        assert not _maps_torch(server.process.pid)
    finally:
        server.stop()


def test_sluice_help_is_light():
    """`sluice --help` imports none of the heavy modules (what keeps it fast; its time is not asserted:
    on a busy machine any import can take half a second)."""
    code = (
        "import sys\n"
        "from sluice.service.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('torch', 'grpc', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout and "generate" in done.stdout and "bench" in done.stdout
