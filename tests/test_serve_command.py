"""`sluice serve` refuses what it cannot serve with one line naming the flag (exit code 2), before it
starts anything, and stops at SIGTERM even while the model loads, leaving no engine core behind; a
killed server's core exits on its own."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import child_pids, process_running
from service_harness import PATIENCE_S

from sluice.engine.config import ModelConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.worker.cpu_memory import available_memory_bytes
from sluice.service.cli import build_parser, load_commands
from sluice.service.listen_address import listen_address
from sluice.service.serve_command import run

pytestmark = pytest.mark.timeout(120)

SLUICE = str(Path(sys.executable).parent / "sluice")


def _serve(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    args = build_parser(load_commands(["serve"])).parse_args(["serve", "--preset", "tiny", *flags])
    code = run(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--max-queue", "0"), "max_queue: must be >= 1 (None: unbounded), got 0"),
        (("--engine-timeout", "0.5"), "engine_timeout: must be > 0.5 s (the core's heartbeat), got 0.5"),
        (("--engine-timeout", "nan"), "engine_timeout: must be > 0.5 s (the core's heartbeat), got nan"),
        (("--grace-period", "nan"), "grace_period: must be >= 0"),
        (("--metrics-port", "-1"), "metrics_port: must be in [0, 65535]"),
        (("--seed", "99999999999999999999"), "seed: 99999999999999999999 is out of range (an int64)"),
        (("--seed", str(2**32)), "seed: must be in [0, 4294967295] (torch's CPU generator takes 32 bits)"),
        (("--seed", "-1"), "seed: must be in [0, 4294967295] (torch's CPU generator takes 32 bits)"),
        (("--max-model-len", str(2**70)), f"max_model_len: {2**70} is out of range (an int64)"),
        # Served, and GetModelInfo, SMG's GetServerInfo and GetLoads then failed on every call (int32s).
        (("--max-num-seqs", "3000000000"), "max_num_seqs: must be at most 2147483647, got 3000000000"),
        (
            ("--max-num-batched-tokens", "3000000000"),
            "max_num_batched_tokens: must be at most 2147483647, got 3000000000",
        ),
        (("--num-blocks", str(2**31)), f"num_blocks: must be at most 2147483647, got {2**31}"),
        (("--max-model-len", str(2**31)), f"max_model_len: must be at most 2147483647, got {2**31}"),
        (
            ("--kv-events", "--no-prefix-caching"),
            "kv-events: the events are the prefix cache's; drop --no-prefix-caching",
        ),
        # An empty key served with no keys at all; one with surrounding whitespace never matched.
        (("--api-key", ""), "api_key: must not be empty"),
        (("--api-key", "sk-1\n"), "api_key: must be printable ASCII without surrounding whitespace"),
        (  # it failed the load with a traceback (OverflowError)
            ("--distributed-timeout-seconds", "inf"),
            "distributed_timeout_seconds: must be in (0, 86400] seconds",
        ),
        # Taken, and only the first StartProfile failed.
        (("--profile-dir", __file__), f"profile_dir: {__file__!r} is not a directory"),
        # Taken, and StartProfile / StopProfile answered success while the core wrote nothing.
        (
            ("--profile-dir", f"{__file__}/profiles"),
            f"profile_dir: {__file__ + '/profiles'!r} cannot be made a directory (Not a directory)",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_the_flag(capsys, flags, message) -> None:
    assert _serve(capsys, *flags) == (2, f"sluice serve: {message}\n")


def test_an_empty_sluice_api_key_is_refused_not_read_as_no_key(capsys, monkeypatch) -> None:
    """An empty Secret behind SLUICE_API_KEY served every caller without a key."""
    monkeypatch.setenv("SLUICE_API_KEY", "")
    assert _serve(capsys) == (2, "sluice serve: api_key: must not be empty\n")


def test_tls_files_are_read_before_serving(capsys, tmp_path) -> None:
    """grpc read them only when binding, and then said it could not bind (or raised FileNotFoundError)."""
    not_pem = tmp_path / "key.txt"
    not_pem.write_text("not a key")
    missing = tmp_path / "missing.pem"
    code, err = _serve(capsys, "--tls-cert", str(missing), "--tls-key", str(not_pem))
    assert (code, err) == (2, f"sluice serve: tls-cert: cannot read {missing}: No such file or directory\n")
    pem = tmp_path / "cert.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    code, err = _serve(capsys, "--tls-cert", str(pem), "--tls-key", str(not_pem))
    assert (code, err) == (2, f"sluice serve: tls-key: {not_pem} is not a PEM file\n")


def test_a_port_or_metrics_port_in_use_is_one_line_naming_it(capsys) -> None:
    """Both ended in a traceback (and the metrics one left the gRPC server running)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = _serve(capsys, "--host", "127.0.0.1", "--port", str(port))
        assert code == 2
        assert err.endswith(
            f"sluice serve: port: cannot listen on 127.0.0.1:{port} (Address already in use)\n"
        )
        code, err = _serve(capsys, "--host", "127.0.0.1", "--port", "0", "--metrics-port", str(port))
        assert code == 2
        assert err.endswith(
            f"sluice serve: metrics_port: cannot listen on 127.0.0.1:{port}: Address already in use\n"
        )


def test_an_ipv6_host_gets_its_brackets() -> None:
    """`--host ::1` became the address "::1:PORT", which grpc cannot bind (and metrics got "[::1]")."""
    assert listen_address("::1", 5) == "[::1]:5"
    assert listen_address("[::]", 5) == "[::]:5"
    assert listen_address("127.0.0.1", 5) == "127.0.0.1:5"
    assert listen_address("localhost", 5) == "localhost:5"


def test_sigterm_while_the_model_loads_stops_the_load_and_its_core(tmp_path) -> None:
    """The core opens its model, a FIFO nobody writes, and waits there until stopped. SIGTERM (the server
    handles it from before it starts the core) once went unheard until the load ended: here, never."""
    process = _serve_a_load_that_never_ends(tmp_path, subprocess.PIPE)
    try:
        core_pids = _wait_for_core(process, time.monotonic() + PATIENCE_S)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=PATIENCE_S)
        assert (process.returncode, out) == (0, ""), err
        assert "stopped while the model loaded" in err
        assert not any(Path(f"/proc/{pid}").exists() for pid in core_pids)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_core_whose_server_was_killed_exits_and_removes_the_servers_sockets(llama_dir: str) -> None:
    """SIGKILL (or the OOM killer) gives the server no chance to stop its core or remove the directory
    of their sockets: the core, finding its parent gone, does both (the directories once piled up in
    /tmp, one per killed server)."""
    process = subprocess.Popen(
        [SLUICE, "serve", "--model", llama_dir, "--port", "0", "--attention-backend", "torch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready = process.stdout.readline()
        assert ready.startswith("sluice ready:"), ready
        core_pid = int(ready.rpartition("core_pid=")[2])
        arguments = Path(f"/proc/{core_pid}/cmdline").read_text().split("\0")
        sockets = Path(arguments[arguments.index("--commands") + 1].removeprefix("ipc://")).parent
        assert sockets.is_dir()
        process.kill()
        process.wait()
        deadline = time.monotonic() + PATIENCE_S
        while process_running(core_pid) or sockets.exists():
            assert time.monotonic() < deadline, f"core running: {process_running(core_pid)}, {sockets} left"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("when", ["started", "listening"])
def test_a_core_whose_server_was_killed_while_it_loads_exits_at_once(tmp_path, when: str) -> None:
    """The core loads a FIFO nobody writes (a load that never ends). Killed as soon as the core process
    has exec'd ("started": the core may not have read the server's pid yet) or once the core listens for the
    config ("listening": it then waits for the config, or loads), the server leaves no core loading on (it
    once loaded to the end, holding the memory a restarted server needs; here, forever) and no directory
    of sockets."""
    process = _serve_a_load_that_never_ends(tmp_path, subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + PATIENCE_S
        core_pids = _wait_for_core(process, deadline)
        cmdline = Path(f"/proc/{core_pids[0]}/cmdline")
        # Until the core's exec, its command line is still the server's (no --commands yet).
        while "--commands" not in (arguments := cmdline.read_text().split("\0")):
            assert time.monotonic() < deadline, f"the core never exec'd: {arguments}"
            time.sleep(0.05)
        commands = Path(arguments[arguments.index("--commands") + 1].removeprefix("ipc://"))
        while when == "listening" and not commands.exists():  # the core binds it before it reads the config
            assert time.monotonic() < deadline, "the core never bound its commands socket"
            time.sleep(0.05)
        process.kill()
        process.wait()
        while (running := process_running(core_pids[0])) or commands.parent.exists():
            assert time.monotonic() < deadline, f"core running: {running}, {commands.parent} left"
            time.sleep(0.05)
    finally:
        for pid in [process.pid, *core_pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()


def _serve_a_load_that_never_ends(tmp_path: Path, streams: int) -> subprocess.Popen:
    """`sluice serve` on a model that is a FIFO nobody writes: its core opens it and waits there."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    return subprocess.Popen(
        [SLUICE, "serve", "--model", str(fifo), "--load-format", "gguf", "--port", "0"],
        stdout=streams,
        stderr=streams,
        text=True,
    )


def _wait_for_core(process: subprocess.Popen, deadline: float) -> list[int]:
    """The pids of the server's children once it has started its engine core."""
    while not (core_pids := child_pids(process.pid)):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no engine core started"
        time.sleep(0.05)
    return core_pids


def test_a_cpu_kv_cache_larger_than_the_memory_left_is_refused_naming_the_setting(llama_dir) -> None:
    """It was allocated page by page until the OOM killer came."""
    too_much = 2 * available_memory_bytes()
    with pytest.raises(
        ValueError, match=r"^kv_cache_memory_bytes: a KV cache of [\d.]+ GiB is more than the "
    ):
        LLM(llama_dir, kv_cache_memory_bytes=too_much)


def test_safetensors_is_refused_for_a_gguf_model(tmp_path) -> None:
    """It was ignored: the GGUF file loaded."""
    message = r"^load_format: 'safetensors' needs a Hugging Face directory as model, got "
    with pytest.raises(ValueError, match=message + "the embedded default model"):
        load_model_source(ModelConfig(load_format="safetensors"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=message + repr(str(gguf))):
        load_model_source(ModelConfig(model=str(gguf), load_format="safetensors"))


def test_an_otlp_protocol_other_than_grpc_is_one_line_naming_the_variable(capsys, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    code, err = _serve(capsys)
    assert (code, err.splitlines()[-1]) == (
        2,
        "sluice serve: OTEL_EXPORTER_OTLP_PROTOCOL: 'http/protobuf' is not supported; "
        "Sluice exports over OTLP/gRPC (grpc)",
    )
