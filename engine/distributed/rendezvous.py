"""Where the ranks of a tensor-parallel group meet: a `TCPStore` that rank 0 serves.

On one node rank 0 listens on 127.0.0.1 at a free port and hands the port to the workers it spawns. A
multi-node group needs every rank to reach it: torch.distributed's usual variables name it
(`MASTER_ADDR`, `MASTER_PORT`; docs/PARALLELISM.md).

The store listens on that address only. Given a host, `TCPStore` still listens on every interface (the
host is where its clients connect), so rank 0 binds the socket itself and hands the store its descriptor:
an unauthenticated store whose keys say where each rank's gloo / NCCL listens stays off the network.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

from torch.distributed import TCPStore

# Connections the listening socket queues before the store accepts them (one per rank, and a few more).
LISTEN_BACKLOG = 128


@dataclass(frozen=True)
class Rendezvous:
    """host:port of rank 0's store, and how long a rank waits for the others there."""

    host: str
    port: int
    timeout_seconds: float

    @classmethod
    def from_env(cls, timeout_seconds: float) -> Rendezvous:
        """MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default 0: a free port, known once served)."""
        return cls(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", "0")),
            timeout_seconds,
        )

    def serve(self, world_size: int) -> tuple[Rendezvous, TCPStore]:
        """Rank 0: the store, listening on `host` only, and this rendezvous with the port it really
        listens on. OSError naming MASTER_ADDR / MASTER_PORT when it cannot listen there (a port another
        server's group holds)."""
        listener = self._listen()
        port = listener.getsockname()[1]
        store = TCPStore(
            self.host,
            port,
            world_size,
            True,
            timeout=self._timeout(),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),  # the store owns (and closes) the socket from here
        )
        return Rendezvous(self.host, store.port, self.timeout_seconds), store

    def join(self, world_size: int) -> TCPStore:
        """Another rank: a client of rank 0's store."""
        return TCPStore(self.host, self.port, world_size, False, timeout=self._timeout())

    def _listen(self) -> socket.socket:
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            listener = socket.socket(family, kind, proto)
        except OSError as exc:
            raise OSError(f"MASTER_ADDR: cannot listen on {self.host!r}: {exc}") from exc
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(LISTEN_BACKLOG)
        except OSError as exc:
            listener.close()
            raise OSError(
                f"MASTER_PORT: the tensor-parallel rendezvous cannot listen on {self.host}:{self.port}: "
                f"{exc.strerror or exc} (unset MASTER_PORT for a free port)"
            ) from exc
        return listener

    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_seconds)
