"""/metrics listens where the gRPC port does: with the default host (0.0.0.0, which grpc binds on IPv4 and
IPv6 alike) it answers over IPv6 too, so Prometheus can scrape a pod whose IP is IPv6. It listened on IPv4
only: the gRPC port and its health probes answered at [::1], /metrics refused the connection."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

from sluice.service.server import ServerConfig, SluiceServer


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


async def test_the_default_host_serves_metrics_over_ipv4_and_ipv6() -> None:
    server = SluiceServer(ServerConfig(host="0.0.0.0", port=0, metrics_port=0))
    await server.start()
    try:
        urls = [f"http://127.0.0.1:{server.metrics_port}/metrics"]
        if socket.has_dualstack_ipv6():  # a host without IPv6 has only the IPv4 listener to check
            urls.append(f"http://[::1]:{server.metrics_port}/metrics")
        for url in urls:
            text = await asyncio.to_thread(scrape, url)
            assert "# TYPE sluice_time_to_first_token_seconds histogram" in text, url
    finally:
        await server.stop(0)
    with socket.socket() as probe:  # stopping the server closed the listener
        assert probe.connect_ex(("127.0.0.1", server.metrics_port)) != 0
