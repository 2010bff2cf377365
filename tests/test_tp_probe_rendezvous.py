"""Rank 0's rendezvous store, as a probe of tensor parallelism found it: `TCPStore` given 127.0.0.1 still
listened on every interface (0.0.0.0 / ::), so any host that reached the machine could read and write the
unauthenticated store where the ranks publish their gloo / NCCL addresses, for the server's lifetime. It
listens on its host only now. A MASTER_PORT another server's group holds is refused naming MASTER_PORT
(it was torch's DistNetworkError with a traceback in the core's log). A one-node group's gloo listens on
the store's loopback address too."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed import ProcessGroupGloo

from sluice.engine.distributed.group import gloo_device
from sluice.engine.distributed.rendezvous import Rendezvous

LISTEN = "0A"  # the TCP state of a listening socket in /proc/net/tcp*


def _listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) of the sockets listening on `port`."""
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] == LISTEN and int(port_hex, 16) == port:
                addresses.append(address)
    return addresses


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
def test_the_store_listens_on_its_host_only() -> None:
    rendezvous, store = Rendezvous("127.0.0.1", 0, 30.0).serve(2)
    try:
        assert rendezvous.port == store.port > 0
        assert _listening_addresses(rendezvous.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 nor ::
        client = Rendezvous("127.0.0.1", rendezvous.port, 30.0).join(2)
        client.set("rank-1", "here")
        assert store.get("rank-1") == b"here"
    finally:
        del store


def test_a_port_in_use_is_refused_naming_master_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"MASTER_PORT: .* 127\.0\.0\.1:{port}: Address already in use"):
            Rendezvous("127.0.0.1", port, 30.0).serve(2)


@pytest.mark.parametrize(
    ("host", "interface", "made"),
    [
        ("127.0.0.1", None, ("create_device", {"hostname": "127.0.0.1"})),
        ("::1", None, ("create_device", {"hostname": "::1"})),
        ("localhost", None, ("create_device", {"hostname": "localhost"})),
        ("10.0.0.5", None, ("create_default_device", {})),  # several nodes: they reach each other there
        ("127.0.0.1", "lo", ("create_device", {"interface": "lo"})),  # GLOO_SOCKET_IFNAME wins
    ],
)
def test_a_one_node_groups_gloo_stays_on_the_stores_loopback_address(
    monkeypatch, host, interface, made
) -> None:
    """gloo's default device listens on the address the machine's hostname resolves to (a pod's IP in
    Kubernetes), so a one-node group's gloo would be on the network beside its loopback store."""
    calls = []
    for factory in ("create_device", "create_default_device"):
        monkeypatch.setattr(ProcessGroupGloo, factory, lambda _f=factory, **kw: calls.append((_f, kw)) or _f)
    if interface is None:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    else:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)
    assert gloo_device(SimpleNamespace(host=host)) == made[0] and calls == [made]
