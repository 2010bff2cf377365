"""grpc.health.v1 answers for each generation service the server serves, not only sluice.v1: a probe or a
client health check naming vllm.grpc.engine.VllmEngine (SMG's worker API, on the same port) follows
loading, serving and draining like the server's own status, instead of NOT_FOUND; List answers them all."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_harness import ServerThread, tiny_engine_config

from sluice.service.server import INFERENCE_SERVICE
from sluice.service.smg_servicer import SERVICE_NAME as SMG_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def statuses(channel: grpc.Channel) -> dict[str, int]:
    """Each service's status as Check answers it, the same as List answers them all (every service the
    server has a status for: these three)."""
    stub = health_pb2_grpc.HealthStub(channel)
    services = ("", INFERENCE_SERVICE, SMG_SERVICE)
    checked = {
        name: stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status for name in services
    }
    listed = stub.List(health_pb2.HealthListRequest(), timeout=10).statuses
    assert {name: response.status for name, response in listed.items()} == checked
    return checked


def test_every_served_generation_service_follows_loading_serving_and_draining(llama_dir: str) -> None:
    thread = ServerThread(tiny_engine_config(llama_dir)).start(attach=False)
    try:
        with thread.channel() as channel:
            assert statuses(channel) == {
                "": NOT_SERVING,
                INFERENCE_SERVICE: NOT_SERVING,
                SMG_SERVICE: NOT_SERVING,
            }
            thread.attach()
            assert statuses(channel) == {"": SERVING, INFERENCE_SERVICE: SERVING, SMG_SERVICE: SERVING}
            thread.call(thread.server.begin_drain())
            assert statuses(channel) == {
                "": NOT_SERVING,
                INFERENCE_SERVICE: NOT_SERVING,
                SMG_SERVICE: NOT_SERVING,
            }
    finally:
        thread.stop()
