"""SMG's cache-aware routing fed by Sluice's KV events (`sluice serve --kv-events`): two workers behind the
real gateway (`smg launch --policy cache_aware`). A prompt cached on a worker by a request the gateway never
saw (sent to the worker directly) is routed to that worker: only the worker's KV events can tell the
gateway where it is cached (its own prefix tree knows only what it routed). That holds for a prompt cached
before the gateway started too: a new subscriber first gets a snapshot of the cache. And the gateway reads
the engine's load from the same stream (pushed, not polled), and in it the engine's silence: a worker
whose engine core stopped answering is routed around before any request of the gateway's waits on it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
import pytest
from fleet_harness import SluiceProcess, SmgGateway, wait_for
from service_harness import UNENDING

from sluice import Client, generate_request

pytestmark = pytest.mark.timeout(600)

BLOCK_SIZE = 16
EVENT_PATIENCE_S = 60.0  # a hang, not a slow machine
# Which worker caches each prompt: not the alternation a load balancer falls into (1 in 16 by chance).
WARMED = (1, 1, 0, 1)


def _prompt(k: int) -> str:
    return f"story {k}: " + " ".join(f"w{k}x{i}" for i in range(30))


def _stored_blocks(gateway: SmgGateway, worker: SluiceProcess) -> float:
    return gateway.metric("smg_kv_event_blocks_total", worker=worker.url, op="stored")


def _indexed_blocks(gateway: SmgGateway, worker: SluiceProcess) -> float:
    """Blocks of `worker` in the gateway's index (a snapshot's count here, not in the stored events)."""
    return gateway.metric("smg_kv_index_blocks", worker=worker.url)


def _warm(worker: SluiceProcess, prompt: str) -> list[int]:
    """Caches `prompt` on `worker` with a request sent to it directly; returns the prompt's token ids."""
    with Client(worker.target) as client:
        # As SMG tokenizes a completion's prompt: no BOS (asserted with prompt_tokens).
        tokens = client.tokenize(prompt, add_special_tokens=False)
        client.complete(generate_request(token_ids=tokens, max_tokens=1, temperature=0.0), timeout=60)
    assert len(tokens) >= 3 * BLOCK_SIZE, len(tokens)
    return tokens


def _served_from_cache(client: openai.OpenAI, model: str, prompt: str, tokens: list[int]) -> bool:
    """Sends `prompt` through the gateway: True if every full block of it came from the prefix cache."""
    response = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    assert response.usage.prompt_tokens == len(tokens)
    return response.usage.prompt_tokens_details.cached_tokens == len(tokens) // BLOCK_SIZE * BLOCK_SIZE


def test_a_prompt_cached_on_a_worker_is_routed_to_it(llama_dir: str, tmp_path: Path) -> None:
    workers: list[SluiceProcess] = []
    gateway = None
    try:
        workers = [
            SluiceProcess(llama_dir, tmp_path / f"worker{i}.log", extra=["--kv-events"]) for i in range(2)
        ]
        early = _warm(workers[1], _prompt(len(WARMED)))  # before the gateway subscribes
        gateway = SmgGateway([w.url for w in workers], tmp_path / "smg.log", policy="cache_aware")
        openai_client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        model = gateway.models()[0]
        # The snapshot of worker 1's cache is in the gateway's index before the events below are counted.
        goal, what = len(early) // BLOCK_SIZE, "the gateway to index worker 1's snapshot"
        wait_for(lambda: _indexed_blocks(gateway, workers[1]) >= goal, EVENT_PATIENCE_S, what)
        for k, index in enumerate(WARMED):
            warmed = workers[index]
            before = _stored_blocks(gateway, warmed)
            tokens = _warm(warmed, _prompt(k))
            goal, what = before + len(tokens) // BLOCK_SIZE, f"the gateway to index worker {index}'s blocks"
            wait_for(lambda w=warmed, g=goal: _stored_blocks(gateway, w) >= g, EVENT_PATIENCE_S, what)
            # Routed to the warmed worker: its prefix cache held every full block of the prompt.
            assert _served_from_cache(openai_client, model, _prompt(k), tokens), k
        # The snapshot the gateway got when it subscribed held the prompt cached before it started.
        assert _served_from_cache(openai_client, model, _prompt(len(WARMED)), early)
    finally:
        if gateway is not None:
            gateway.close()
        for worker in workers:
            worker.close()


def _pushed_running(gateway: SmgGateway) -> int | None:
    """Running requests of the gateway's one worker as its last load record pushed on the KV event stream
    said (None while its record is a poll's)."""
    load = gateway.get("/workers")["workers"][0].get("engine_load") or {}
    return load["loads"][0]["num_running_reqs"] if load.get("version") == "pushed" else None


def test_the_gateway_reads_the_engines_load_from_its_event_stream(
    llama_long_dir: str, tmp_path: Path
) -> None:
    # KV blocks for an UNENDING request: one that runs until the test ends it.
    worker = SluiceProcess(
        llama_long_dir, tmp_path / "worker.log", extra=["--kv-events", "--kv-cache-memory", "80MiB"]
    )
    gateway = None
    try:
        # One poll at registration, the next in an hour: any later change it knows of was pushed.
        gateway = SmgGateway([worker.url], tmp_path / "smg.log", extra=["--load-monitor-interval", "3600"])
        wait_for(lambda: _pushed_running(gateway) == 0, EVENT_PATIENCE_S, "a pushed record of an idle engine")
        with Client(worker.target) as client:  # sent to the worker directly: the gateway never sees it
            stream = client.generate(generate_request("hold", **UNENDING), timeout=EVENT_PATIENCE_S)
            next(iter(stream))
            wait_for(
                lambda: _pushed_running(gateway) == 1, EVENT_PATIENCE_S, "a pushed record of its request"
            )
            stream.close()
        wait_for(lambda: _pushed_running(gateway) == 0, EVENT_PATIENCE_S, "a pushed record of its end")
        assert gateway.metric("smg_kv_event_batches_total", worker=worker.url, disposition="load_only") > 0
    finally:
        if gateway is not None:
            gateway.close()
        worker.close()


def test_a_worker_whose_engine_went_silent_is_routed_around(llama_long_dir: str, tmp_path: Path) -> None:
    """Worker 0's engine core is stopped (SIGSTOP) while a request sent to it directly is live: its
    frontend's load records report the growing silence, the gateway vetoes it as wedged, and every request
    the gateway then routes goes to worker 1 (none waits on the stopped core: worker 0 ends no Generate
    call, even after the core resumes). Worker 0 would declare a silent core dead only after an hour."""
    extra = ["--kv-events", "--kv-cache-memory", "80MiB"]
    workers = [
        SluiceProcess(llama_long_dir, tmp_path / "worker0.log", extra=[*extra, "--engine-timeout", "3600"]),
        SluiceProcess(llama_long_dir, tmp_path / "worker1.log", extra=extra),
    ]
    gateway, core = None, None
    try:
        gateway = SmgGateway([w.url for w in workers], tmp_path / "smg.log")
        openai_client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        model = gateway.models()[0]
        with Client(workers[0].target) as client:
            stream = client.generate(generate_request("hold", **UNENDING), timeout=EVENT_PATIENCE_S * 4)
            next(iter(stream))
            core = workers[0].core_pid
            os.kill(core, signal.SIGSTOP)

            def stalled() -> str | None:
                listed = {w["url"]: w for w in gateway.get("/workers")["workers"]}
                return listed[workers[0].url].get("stalled")

            wait_for(lambda: stalled() == "wedged", EVENT_PATIENCE_S, "the gateway to veto the silent worker")
            before = [w.rpc_count("VllmEngine.Generate", code=None) for w in workers]
            for k in range(6):
                response = openai_client.completions.create(
                    model=model, prompt=f"request {k}", max_tokens=2, temperature=0, timeout=EVENT_PATIENCE_S
                )
                assert response.choices[0].finish_reason == "length"
            assert workers[1].rpc_count("VllmEngine.Generate", code=None) == before[1] + 6
            os.kill(core, signal.SIGCONT)
            core = None
            stream.close()
        wait_for(lambda: workers[0].finished("abort") == 1, EVENT_PATIENCE_S, "the held request's end")
        assert workers[0].rpc_count("VllmEngine.Generate", code=None) == before[0]
    finally:
        if core is not None:
            os.kill(core, signal.SIGCONT)
        if gateway is not None:
            gateway.close()
        for worker in workers:
            worker.close()
