"""`sluice bench` against a real Sluice server on a loopback port: JSON, charts, sweeps, errors."""

from __future__ import annotations

import asyncio
import json

import pytest
from service_harness import ServerThread, tiny_engine_config

from sluice.bench.runner import LoadConfig, run_load
from sluice.bench.transports import StreamTransport
from sluice.bench.workloads import Workload
from sluice.client import AsyncClient
from sluice.service.cli import main

METRIC_KEYS = {
    "num_requests", "num_completed", "errors", "duration_seconds", "prompt_tokens", "output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput", "goodput",
    "ttft", "tpot", "itl", "e2e", "cached_prompt_tokens", "computed_prompt_tokens",
}  # fmt: skip


@pytest.fixture(scope="module")
def server(llama_dir: str):
    """The 256-token tiny Llama, whose context a 300-token prompt exceeds (the conftest's has 131,072)."""
    thread = ServerThread(tiny_engine_config(llama_dir)).start()
    yield thread
    thread.stop()


def _bench(server: ServerThread, *args: str) -> int:
    return main(["bench", "--target", server.target, "--no-progress", "--input-len", "16", *args])


def test_closed_loop_run_writes_json_and_charts(server: ServerThread, tmp_path, capsys) -> None:
    path, charts = tmp_path / "run.json", tmp_path / "charts"
    slo = ["--slo-ttft", "60000", "--slo-tpot", "60000"]
    rc = _bench(server, "--num-requests", "6", "--concurrency", "3", "--output-len", "8", *slo,
                "--json", str(path), "--plot", str(charts))  # fmt: skip
    assert rc == 0
    (run,) = json.loads(path.read_text())["runs"]
    m = run["metrics"]
    assert set(m) == METRIC_KEYS
    assert (m["num_requests"], m["num_completed"], m["errors"]) == (6, 6, {})
    assert (m["prompt_tokens"], m["output_tokens"]) == (6 * 16, 6 * 8)
    assert (m["cached_prompt_tokens"], m["computed_prompt_tokens"]) == (0, 6 * 16)
    assert run["cache_hits_unexpected"] is False
    assert m["goodput"] == pytest.approx(m["request_throughput"])  # every request meets a 60 s SLO
    assert m["ttft"]["count"] == 6 and m["tpot"]["count"] == 6
    # One gap per chunk after the first: how many chunks a fast server merged the 8 tokens into varies.
    assert m["itl"]["count"] == sum(len(r["itls"]) for r in run["requests"])
    assert all(len(r["itls"]) <= 7 for r in run["requests"])
    assert [r["output_tokens"] for r in run["requests"]] == [8] * 6
    assert [r["index"] for r in sorted(run["requests"], key=lambda r: r["index"])] == list(range(6))
    assert run["config"]["concurrency"] == 3 and run["config"]["request_rate"] is None
    assert run["config"]["workload"]["vocab_size"] == 512  # read from GetModelInfo
    assert (charts / "latency_cdfs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "6/6" in table and "TTFT p99" in table
    server.wait_idle()


def test_sweep_on_one_bidi_stream_with_poisson_arrivals(server: ServerThread, tmp_path) -> None:
    path, charts = tmp_path / "sweep.json", tmp_path / "charts"
    rc = _bench(server, "--api", "stream", "--workload", "shared-prefix", "--prefix-len", "32",
                "--request-rate", "50", "--sweep", "1,4", "--num-requests", "5", "--output-len", "4",
                "--json", str(path), "--plot", str(charts))  # fmt: skip
    assert rc == 0
    runs = json.loads(path.read_text())["runs"]
    assert [r["label"] for r in runs] == ["concurrency 1", "concurrency 4"]
    assert [(r["metrics"]["num_completed"], r["metrics"]["output_tokens"]) for r in runs] == [(5, 20)] * 2
    assert all(r["metrics"]["prompt_tokens"] == 5 * 48 for r in runs)
    # The warm-up computed each run's 32-token system prompt (two blocks); every request reads it from
    # the prefix cache, as the workload asks, and computes its own 16 tokens: nothing is flagged.
    assert [r["config"]["run_index"] for r in runs] == [0, 1]
    assert runs[0]["config"]["workload"]["seed"] != runs[1]["config"]["workload"]["seed"]
    for run in runs:
        assert [q["cached_tokens"] for q in run["requests"]] == [32] * 5
        assert [q["prompt_tokens_computed"] for q in run["requests"]] == [16] * 5
        assert (run["shared_prefix_len"], run["cache_hits_unexpected"]) == (32, False)
    assert (charts / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    server.wait_idle()


def test_rejected_requests_are_counted_by_status_code(server: ServerThread, tmp_path) -> None:
    path = tmp_path / "errors.json"
    # 300 prompt tokens exceed the checkpoint's 256-token context: RESOURCE_EXHAUSTED for each.
    rc = main(["bench", "--target", server.target, "--no-progress", "--input-len", "300",
               "--num-requests", "3", "--json", str(path)])  # fmt: skip
    assert rc == 1
    m = json.loads(path.read_text())["runs"][0]["metrics"]
    assert (m["num_requests"], m["num_completed"], m["errors"]) == (3, 0, {"RESOURCE_EXHAUSTED": 3})
    assert m["ttft"]["p99"] is None


def test_stream_transport_fails_requests_sent_after_the_call_ended(llama_dir: str) -> None:
    # The model is still loading, so the server ends the one StreamGenerate call at once; the requests
    # that arrive later on the Poisson clock must fail with the call's status too, not wait forever.
    server = ServerThread(tiny_engine_config(llama_dir)).start(attach=False)
    workload = Workload("fixed", 512, input_len=4, output_len=2)
    load = LoadConfig(num_requests=3, request_rate=20, warmup_requests=0)

    async def bench():
        transport = StreamTransport(AsyncClient(server.target))
        try:
            return await asyncio.wait_for(run_load(transport, workload, load), 30)
        finally:
            await transport.close()

    try:
        result = asyncio.run(bench())
    finally:
        server.stop()
    # The server ends the call UNAVAILABLE; when that races the client's first write, gRPC core reports
    # the call as INTERNAL ("Internal error from Core") instead. Either way every request gets it.
    (code,) = result.metrics.errors
    assert code in ("UNAVAILABLE", "INTERNAL")
    assert (result.metrics.num_requests, result.metrics.errors[code]) == (3, 3)
