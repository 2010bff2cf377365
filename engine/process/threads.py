"""Thread settings of the engine core process, the only process of a server that runs torch.

One OpenMP pool, sized to the physical cores the process may run on (hyper-threads share a core's
vector units and only add contention to GEMMs); inter-op parallelism off, since a decode step is a chain
of dependent ops. The gRPC frontend never imports torch, so it starts no second pool.

The pool's threads spin only briefly before they sleep (`core_process_environment`). By default libgomp
spins 300,000 times (about 10 ms on a Zen 5, 35 ns a pause) after every parallel region before a thread
sleeps: after each step a thread then holds a core while the frontend and the gRPC clients, on the same
cores, need it to stream the step's tokens, and on a busy machine a thread whose partner was preempted
spins through its time slice. A short spin still catches parallel regions that follow each other closely
(the kernels of the C++ decoder stack), so it should cost at most a wake-up per longer gap, where
OMP_WAIT_POLICY=PASSIVE would pay one per parallel region. Measured: docs/BENCHMARKS.md ("Figures behind
the code"); the offline `LLM` runs in the caller's process and keeps libgomp's default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from sluice.engine.process.host_memory import with_malloc_tunables

# Spins of a waiting OpenMP thread before it sleeps, in the engine core process (libgomp's default: 300,000).
CORE_GOMP_SPINCOUNT = "1000"


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


# Secrets of the frontend's that the core (and its tensor-parallel workers, which inherit its environment)
# never needs: the server's API key.
FRONTEND_ONLY_VARIABLES = ("SLUICE_API_KEY",)


def core_process_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment to start the engine core process with: `environ` without FRONTEND_ONLY_VARIABLES,
    plus GOMP_SPINCOUNT (a short spin), unless `environ` sets OMP_WAIT_POLICY or GOMP_SPINCOUNT itself,
    and glibc's malloc tunables for reusing freed memory (`host_memory.with_malloc_tunables`)."""
    env = with_malloc_tunables({k: v for k, v in environ.items() if k not in FRONTEND_ONLY_VARIABLES})
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = CORE_GOMP_SPINCOUNT
    return env
