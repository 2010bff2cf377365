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


async def test_a_named_host_serves_metrics_on_every_address_it_resolves_to(monkeypatch) -> None:
    """As grpc listens: "localhost" of a standard /etc/hosts is 127.0.0.1 and ::1, and /metrics answered
    on the first alone (prometheus_client binds one address), refusing a scraper of the other."""
    addresses = [("127.0.0.1", socket.AF_INET)]
    if socket.has_ipv6:
        addresses.insert(0, ("::1", socket.AF_INET6))
    resolve = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host != "localhost":
            return resolve(host, port, *args, **kwargs)
        return [
            (
                family,
                socket.SOCK_STREAM,
                6,
                "",
                (address, port, 0, 0)[: 4 if family == socket.AF_INET6 else 2],
            )
            for address, family in addresses
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    server = SluiceServer(ServerConfig(host="localhost", port=0, metrics_port=0))
    await server.start()
    try:
        for address, family in addresses:
            host = f"[{address}]" if family == socket.AF_INET6 else address
            text = await asyncio.to_thread(scrape, f"http://{host}:{server.metrics_port}/metrics")
            assert "# TYPE sluice_time_to_first_token_seconds histogram" in text, address
    finally:
        await server.stop(0)
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", server.metrics_port)) != 0
