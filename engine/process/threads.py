"""Thread settings of the engine core process, the only process of a server that runs torch.

One OpenMP pool, sized to the physical cores the process may run on (hyper-threads share a core's
vector units and only add contention to GEMMs); inter-op parallelism off, since a decode step is a chain
of dependent ops. The gRPC frontend never imports torch, so it starts no second pool.
"""

from __future__ import annotations

import os
from pathlib import Path


def physical_cores_available() -> int:
    """Physical cores among the CPUs this process may run on (sibling hyper-threads counted once)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.add(siblings.read_text().strip() if siblings.is_file() else str(cpu))
    return max(1, len(cores))


def configure_torch_threads(num_threads: int | None) -> int:
    """Sets torch's intra-op threads (default: `physical_cores_available()`); returns the number."""
    import torch

    num_threads = num_threads or physical_cores_available()
    torch.set_num_threads(num_threads)
    torch.set_num_interop_threads(1)
    return num_threads
