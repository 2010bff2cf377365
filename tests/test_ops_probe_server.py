"""What `sluice serve` says when it cannot listen, and what its drain logs, found by an operations probe:
a bad `--host` was reported as the port's fault ("port: ... (in use, or no address of this host)"), and
`--grace-period 0` (or anything up to HEALTH_NOTICE_S) logged a warning that calls were still arriving."""

from __future__ import annotations

import logging
import socket

import pytest

from sluice.service.listen_address import ListenError, bind_failure
from sluice.service.server import HEALTH_NOTICE_S, ServerConfig, SluiceServer

TEST_NET = "192.0.2.1"  # RFC 5737: an address no host of a test machine has


@pytest.mark.parametrize(
    ("host", "message"),
    [
        (
            "nonexistent.invalid",
            "host: cannot listen on nonexistent.invalid:0: cannot resolve 'nonexistent.invalid' ",
        ),
        (TEST_NET, f"host: cannot listen on {TEST_NET}:0 (Cannot assign requested address)"),
    ],
)
async def test_a_host_that_is_not_this_machines_is_refused_naming_the_host(host: str, message: str) -> None:
    server = SluiceServer(ServerConfig(host=host, port=0))
    try:
        with pytest.raises(ListenError) as refused:
            await server.start()
    finally:
        await server.stop(0)
    assert str(refused.value).startswith(message)


def test_a_port_in_use_is_the_ports_fault_with_the_reason() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert (
            bind_failure("127.0.0.1", port)
            == f"port: cannot listen on 127.0.0.1:{port} (Address already in use)"
        )


@pytest.mark.parametrize("grace_period", [0.0, HEALTH_NOTICE_S])
async def test_a_grace_period_too_short_to_wait_for_quiet_is_no_warning(
    grace_period: float, caplog: pytest.LogCaptureFixture
) -> None:
    server = SluiceServer(ServerConfig(host="127.0.0.1", port=0, grace_period=grace_period))
    await server.start()
    with caplog.at_level(logging.INFO, logger="sluice.service.server"):
        await server.drain()
    messages = [(record.levelno, record.getMessage()) for record in caplog.records]
    assert messages == [
        (
            logging.INFO,
            f"draining: grace period {grace_period:.2f} s, no time to wait for calls to stop: GOAWAY",
        )
    ]
