"""A second server on the port of a running one is refused (ListenError naming the port; `sluice serve`
exits 2), instead of starting beside it: grpc sets SO_REUSEPORT by default, and the kernel then spread new
connections over both servers (a restarted or misconfigured replica silently took a share of the calls)."""

from __future__ import annotations

import pytest

from sluice.service.listen_address import ListenError
from sluice.service.server import ServerConfig, SluiceServer


async def test_a_second_server_on_a_port_in_use_is_refused() -> None:
    first = SluiceServer(ServerConfig(host="127.0.0.1", port=0))
    port = await first.start()
    try:
        second = SluiceServer(ServerConfig(host="127.0.0.1", port=port))
        try:
            with pytest.raises(ListenError, match=f"port: cannot listen on 127.0.0.1:{port} "):
                await second.start()
        finally:
            await second.stop(0)
    finally:
        await first.stop(0)
    # Once the first has stopped, the port is free again.
    third = SluiceServer(ServerConfig(host="127.0.0.1", port=port))
    assert await third.start() == port
    await third.stop(0)
