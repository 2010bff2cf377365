"""A long engine step on the CPU is not a hang: while it uses the CPU the core's `StepWatch` sends
`CoreBusy`, so the frontend's silence watchdog (the engine timeout) lets it run; a step that stalls without
using the CPU is still found hung. The steps are held by SLUICE_INJECT_FAULT ("busy" / "stall", for
SLOW_STEP_S: three engine timeouts here); the real engine core process runs a tiny checkpoint."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from service_harness import PATIENCE_S

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.faults import ENV_VAR as FAULT_VAR
from sluice.engine.faults import SLOW_STEP_S
from sluice.engine.frontend.core_client import CoreClient
from sluice.engine.messages import AddRequest, CoreMessage, CoreOutputs
from sluice.engine.sampling_params import SamplingParams

TIMEOUT_S = SLOW_STEP_S / 3  # silence for this long is a hang
HEARTBEAT_S = 0.1


async def _run_marked_request(model_dir: str, monkeypatch: pytest.MonkeyPatch, fault: str) -> str | None:
    """Runs one request whose first step the fault holds; None if it finished, else why the engine died."""
    monkeypatch.setenv(FAULT_VAR, f"{fault}:held")
    config = EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu"),
        cache=CacheConfig(block_size=16),
        attention_backend="torch",
    )
    client = CoreClient(config, heartbeat_seconds=HEARTBEAT_S, timeout_seconds=TIMEOUT_S)
    finished, dead, reasons = asyncio.Event(), asyncio.Event(), []

    def on_message(message: CoreMessage) -> None:
        if isinstance(message, CoreOutputs) and any(o.finish_reason for o in message.outputs):
            finished.set()

    def on_dead(reason: str) -> None:
        reasons.append(reason)
        dead.set()

    await client.start(on_message, on_dead)
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        client.send(AddRequest("held-1", [1, 2, 3, 4, 5], params, time.time()))
        waits = [asyncio.ensure_future(finished.wait()), asyncio.ensure_future(dead.wait())]
        await asyncio.wait(waits, timeout=PATIENCE_S + SLOW_STEP_S, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        assert finished.is_set() or dead.is_set(), "neither finished nor failed"
        return reasons[0] if reasons else None
    finally:
        await client.shutdown()


async def test_a_step_that_runs_long_on_the_cpu_is_not_a_hang(llama_long_dir, monkeypatch, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="sluice.engine.frontend.core_client"):
        assert await _run_marked_request(llama_long_dir, monkeypatch, "busy") is None
    # The step ran past the timeout and the frontend heard it was busy (CoreBusy) meanwhile.
    logged = [r.getMessage() for r in caplog.records]
    assert any("past the engine timeout" in m and "the core is busy" in m for m in logged), logged


async def test_a_step_that_stalls_without_the_cpu_is_a_hang(llama_long_dir, monkeypatch) -> None:
    reason = await _run_marked_request(llama_long_dir, monkeypatch, "stall")
    assert reason is not None and reason.startswith("the engine core stopped answering (")
