"""Where the ranks of a tensor-parallel group meet: a `TCPStore` that rank 0 serves.

On one node rank 0 listens on 127.0.0.1 at a free port and hands the port to the workers it spawns. A
multi-node group needs every rank to reach it: torch.distributed's usual variables name it
(`MASTER_ADDR`, `MASTER_PORT`; docs/PARALLELISM.md).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from torch.distributed import TCPStore


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
        """Rank 0: the store, and this rendezvous with the port it really listens on."""
        store = TCPStore(
            self.host, self.port, world_size, True, timeout=self._timeout(), wait_for_workers=False
        )
        return Rendezvous(self.host, store.port, self.timeout_seconds), store

    def join(self, world_size: int) -> TCPStore:
        """Another rank: a client of rank 0's store."""
        return TCPStore(self.host, self.port, world_size, False, timeout=self._timeout())

    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_seconds)
