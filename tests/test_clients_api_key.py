"""The Go and Java examples against a server started with an API key: `--api-key KEY` (or SLUICE_API_KEY, as
`sluice generate` takes it) sends `authorization: Bearer KEY` on every call, and the examples stream, abort
and multiplex as without one; with no key they exit 1 with the server's UNAUTHENTICATED. They had no way to
send a key: against any server with --api-key or --api-keys they could only fail."""

from __future__ import annotations

import os
import subprocess

import pytest
import test_clients_go_java
from checkpoints import LONG_CONTEXT
from service_harness import ServerThread, long_engine_config
from test_clients_go_java import check_results, run_example

from sluice.service.server import ServerConfig

KEY = "sk-example-0123"

# The greedy tokens of transformers, which the examples stream over plaintext (a module fixture).
reference = test_clients_go_java.reference


@pytest.fixture(scope="module")
def keyed_server(llama_long_dir: str):
    config = ServerConfig(host="127.0.0.1", port=0, api_key=KEY)
    thread = ServerThread(long_engine_config(llama_long_dir), config).start()
    yield thread
    thread.stop()


def _run(language: str, target: str, extra: list[str], key_in_env: bool) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if name != "SLUICE_API_KEY"}
    if key_in_env:
        env["SLUICE_API_KEY"] = KEY
    return run_example(language, target, *extra, check=False, env=env)


@pytest.mark.parametrize("language", ["go", "java"])
@pytest.mark.parametrize("given", ["flag", "environment"])
def test_the_example_sends_its_api_key(
    language: str, given: str, keyed_server: ServerThread, reference
) -> None:
    flag = given == "flag"
    result = _run(language, keyed_server.target, ["--api-key", KEY] if flag else [], key_in_env=not flag)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    check_results(language, result.stdout.splitlines(), reference, LONG_CONTEXT)
    assert keyed_server.wait_idle().num_kv_blocks_used == 0


@pytest.mark.parametrize("language", ["go", "java"])
def test_without_a_key_the_example_exits_1_unauthenticated(language: str, keyed_server: ServerThread) -> None:
    result = _run(language, keyed_server.target, [], key_in_env=False)
    assert result.returncode == 1, result.stdout
    # grpc-java prints the code as UNAUTHENTICATED, grpc-go as Unauthenticated.
    assert "unauthenticated" in result.stderr.lower(), result.stderr
    assert "authorization: missing" in result.stderr, result.stderr
