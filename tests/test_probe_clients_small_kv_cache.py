"""The Go and Java examples against a server whose KV cache holds less than one request of max_model_len (a
configuration the server takes, warning at start: a long-context model on a GPU of less memory). Their
requests cancelled mid-stream took max_tokens = max_model_len - prompt by default, which such a server
refuses (RESOURCE_EXHAUSTED "max_tokens: needs 8192 KV blocks but the cache has 8000"): the documented
`run_example.sh --addr HOST:PORT` failed. Now they take what the KV cache holds where it holds less
(GetModelInfo's kv_capacity_tokens)."""

from __future__ import annotations

import pytest
from checkpoints import LONG_CONTEXT
from service_harness import ServerThread, tiny_engine_config
from test_clients_go_java import parse, run_example

# 192 blocks short of one request of max_model_len: still minutes of decoding for the requests the
# examples cancel after their first chunk.
NUM_BLOCKS = LONG_CONTEXT // 16 - 192


@pytest.fixture(scope="module")
def small_cache_server(llama_long_dir: str):
    thread = ServerThread(tiny_engine_config(llama_long_dir, num_blocks=NUM_BLOCKS)).start()
    yield thread
    thread.stop()


@pytest.mark.parametrize("language", ["go", "java"])
def test_example_runs_on_a_kv_cache_smaller_than_the_context(language: str, small_cache_server) -> None:
    lines = run_example(language, small_cache_server.target).stdout.splitlines()
    assert lines[-1] == "done", lines
    results = parse(lines)
    names = ("generate", "abort", "bidi-0", "bidi-1")
    length, abort = "FINISH_REASON_LENGTH", "FINISH_REASON_ABORT"
    finishes = [results[f"{language}-{name}"]["finish"] for name in names]
    assert finishes == [length, abort, length, abort], lines
    assert small_cache_server.wait_idle().num_kv_blocks_used == 0
