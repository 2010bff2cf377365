"""`--max-connection-age` and `--max-connection-age-grace` past grpc's int32-millisecond limit (about 24.8
days) or `inf` start a server whose connections are, in effect, never aged out, instead of a traceback
(grpc refused the option: OverflowError)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.service.cli import build_parser, load_commands
from sluice.service.serve_command import server_config
from sluice.service.server import GRPC_MAX_MS, MAX_PENDING_CALLS, ServerConfig, SluiceServer, grpc_millis


@pytest.mark.parametrize(
    ("age", "grace"), [("inf", "120"), ("3000000", "120"), ("300", "inf"), ("300", "1e10"), ("inf", "inf")]
)
async def test_a_connection_age_past_grpcs_limit_starts_a_server(age: str, grace: str) -> None:
    args = build_parser(load_commands(["serve"])).parse_args(
        ["serve", "--host", "127.0.0.1", "--port", "0", "--max-connection-age", age]
        + ["--max-connection-age-grace", grace]
    )
    server = SluiceServer(server_config(args))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # up, no engine attached
    finally:
        await server.stop(0)


def test_connection_age_options_in_grpcs_milliseconds() -> None:
    options = dict(ServerConfig(max_connection_age=float("inf"), max_connection_age_grace=2.5).grpc_options())
    assert options["grpc.max_connection_age_ms"] == GRPC_MAX_MS == 2**31 - 1
    assert options["grpc.max_connection_age_grace_ms"] == 2500
    assert [grpc_millis(s) for s in (0.0, 300.0, 2_147_483.647, 2_147_483.648, 1e12)] == [
        0,
        300_000,
        GRPC_MAX_MS,
        GRPC_MAX_MS,
        GRPC_MAX_MS,
    ]


def test_grpc_holds_a_bursts_calls_for_admission_control() -> None:
    """grpc's defaults dropped the calls past 1,000 waiting for the event loop (CANCELLED, uncounted, never
    retried): 667 of a burst of 3,000 Generate calls on a 2-core machine; admission control refuses the
    excess with RESOURCE_EXHAUSTED instead."""
    options = dict(ServerConfig().grpc_options())
    assert options["grpc.server.max_pending_requests"] == MAX_PENDING_CALLS >= 20_000
    assert options["grpc.server.max_pending_requests_hard_limit"] == 2 * MAX_PENDING_CALLS


def test_the_api_key_is_never_in_the_configs_repr() -> None:
    assert "sk-secret" not in repr(ServerConfig(api_key="sk-secret"))


@pytest.mark.parametrize("age", [1e-9, 0.0009, -1.0, float("nan")])
def test_an_age_grpc_would_round_to_0_ms_is_refused_saying_how_to_disable_it(age: float) -> None:
    with pytest.raises(ValueError, match=r"max_connection_age: must be >= 0\.001 seconds \(0 on the command"):
        ServerConfig(max_connection_age=age)
    assert dict(ServerConfig(max_connection_age=0.001).grpc_options())["grpc.max_connection_age_ms"] == 1
