"""An engine core that dies after it started and before the server watches it (`sluice serve` awaits the
load, then attaches the engine: a core that exits in between) must still fail the pod. `AsyncEngine.on_dead`
told only the listeners it had when the core died, so the server's, added later, never ran: health went
SERVING for an engine that answers every call UNAVAILABLE, and `engine_failed` was never set, so
`sluice serve` never exited for the orchestrator to restart it. A listener added after the death now runs
at once."""

from __future__ import annotations

import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_harness import ServerThread, tiny_engine_config, wait_for

from sluice import generate_request
from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.service.server import HEALTH_SERVICES

pytestmark = pytest.mark.timeout(120)

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_an_engine_that_died_before_it_was_attached_fails_health_and_the_server(llama_dir: str) -> None:
    thread = ServerThread(tiny_engine_config(llama_dir)).start(attach=False)
    try:
        engine = AsyncEngine(tiny_engine_config(llama_dir))
        thread.engine = engine  # stopped with the server
        thread.call(engine.start())
        os.kill(engine.core_pid, signal.SIGKILL)
        wait_for(lambda: engine.error is not None, "the engine noticing its core died")
        thread.call(thread.server.attach_engine(engine))
        assert thread.server.engine_failed.is_set()  # `sluice serve` exits 1
        with thread.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def statuses() -> set[int]:
                return {stub.Check(health_pb2.HealthCheckRequest(service=s)).status for s in HEALTH_SERVICES}

            wait_for(lambda: statuses() == {NOT_SERVING}, "NOT_SERVING on every health service")
            # A channel without client health checking reaches the server, which refuses the call.
            with pytest.raises(grpc.RpcError) as info:
                list(thread.stub(channel).Generate(generate_request("Hi", max_tokens=1), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details().startswith("the engine failed: ")
    finally:
        thread.stop()
