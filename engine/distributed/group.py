"""A rank's place in its tensor-parallel group, and the collectives the layers call.

    group = TensorParallelGroup.single()          # one process: rank 0 of 1, collectives return their input
    group = TensorParallelGroup.join(store, rank, size, device, timeout_seconds)
                                                   # gloo between CPU processes, NCCL between GPUs

The group holds torch.distributed's own backend object (`ProcessGroupGloo` / `ProcessGroupNCCL`) built on
the rendezvous store, and reaches the layers through the `KernelConfig`: no default (global) process group,
so a process (an offline `LLM`'s) may hold several engines, and a layer never looks a group up.

Every collective is called in the same order on every rank (the ranks run the same step), with a timeout:
a rank that stops answering fails the others' collective after `timeout_seconds`; one that exits fails it
at once (its sockets close). NCCL collectives are CUDA-graph capturable: the row-parallel all-reduces are
captured with the decode graphs. Gloo runs on CPU tensors only, without graphs.
"""

from __future__ import annotations

import datetime
import ipaddress
import os

import torch
from torch.distributed import AllreduceOptions, BroadcastOptions, ProcessGroup, ReduceOp, Store


class TensorParallelGroup:
    """rank of size; `device` holds the tensors its collectives take."""

    def __init__(
        self, rank: int, size: int, device: torch.device, process_group: ProcessGroup | None = None
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank: {rank} is not in 0..{size - 1}")
        if size > 1 and process_group is None:
            raise ValueError("process_group: a group of more than one rank needs one")
        self.rank = rank
        self.size = size
        self.device = device
        self._process_group = process_group

    @classmethod
    def single(cls) -> TensorParallelGroup:
        """No parallelism: rank 0 of 1."""
        return cls(0, 1, torch.device("cpu"))

    @classmethod
    def join(
        cls, store: Store, rank: int, size: int, device: torch.device, timeout_seconds: float
    ) -> TensorParallelGroup:
        """Builds the backend's group on `store` (blocks until all `size` ranks joined): NCCL on cuda, gloo
        on cpu."""
        timeout = datetime.timedelta(seconds=timeout_seconds)
        if device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            return cls(rank, size, device, ProcessGroupNCCL(store, rank, size, options))
        from torch.distributed import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [gloo_device(store)]
        return cls(rank, size, device, ProcessGroupGloo(store, rank, size, options))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place (x must be contiguous); returns x."""
        if self.size > 1:
            self._process_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] on every rank -> [..., size * n]: rank 0's columns, then rank 1's, ..."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._process_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (x contiguous, of one shape and dtype on every rank);
        returns x."""
        if self.size > 1:
            options = BroadcastOptions()
            options.rootRank = 0
            self._process_group.broadcast([x], options).wait()
        return x

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        return self._reduce(value, ReduceOp.MIN)

    def sum(self, value: int) -> int:
        """The sum of every rank's `value`."""
        return self._reduce(value, ReduceOp.SUM)

    def _reduce(self, value: int, op: ReduceOp) -> int:
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = AllreduceOptions()
        options.reduceOp = op
        self._process_group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, size={self.size}, device={self.device})"


def gloo_device(store: Store) -> object:
    """The network device of a rank's gloo group: on `GLOO_SOCKET_IFNAME`'s interface (as torch.distributed
    reads it); else, for a store on a loopback address (one node), on that address, so gloo's sockets stay
    off the network as the store's do (gloo's default device listens on the address the machine's hostname
    resolves to: a pod's IP in Kubernetes); else gloo's default (several nodes reach each other there)."""
    from torch.distributed import ProcessGroupGloo

    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return ProcessGroupGloo.create_device(interface=interface)
    host = getattr(store, "host", "")
    if _is_loopback(host):
        return ProcessGroupGloo.create_device(hostname=host)
    return ProcessGroupGloo.create_default_device()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
