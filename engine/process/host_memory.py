"""Host-memory settings of the engine core process.

A CPU step allocates its activations afresh (a prefill chunk's gate/up output is 25 MB on SmolLM2-135M,
the logits of a 256-sequence decode 50 MB). By default glibc serves blocks that big with mmap and hands them
back on free, so every step pays the kernel to fault in and zero its buffers again (docs/BENCHMARKS.md,
"Figures behind the code"). `retain_freed_memory` serves every block from the heap and keeps freed heap
memory for reuse (what vLLM's and IPEX's CPU guides get by preloading tcmalloc or jemalloc), at the cost of
holding on to the peak of a step's temporaries. `freeze_gc_heap` takes what loading left alive out of the
garbage collector's reach.

Serving from the heap needs glibc's per-thread cache (tcache) off in that process: torch allocates with
posix_memalign, whose spare tail (a few dozen bytes) goes into the tcache, where it stays marked in use, so
the freed block next to it is never merged back into the heap's top; a block of the same size asked for
again then came from fresh memory, faulted in afresh (glibc 2.36-9+deb12u14: a 64 MiB block freed and asked
for again 50 times left the heap 384 MiB larger). The tcache is set when a process starts, so the engine
core process is started with `MALLOC_TUNABLES` in its environment (`with_malloc_tunables`, through
`threads.core_process_environment`); a benchmark that calls `retain_freed_memory` in its own process should
be started with it too. Small allocations without the tcache measured no slower here (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # free heap top kept up to 1 GiB
# No block is mmap'd. A threshold cannot do it: glibc's largest is 32 MiB, and a bigger block was then
# mapped afresh each step unless the heap happened to hold a free chunk that size (the 50 MB logits of a
# 256-sequence decode: in one process out of two, 12,300 page faults a step).
MMAP_MAX = 0


MALLOC_TUNABLES = "glibc.malloc.tcache_count=0"


def with_malloc_tunables(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with MALLOC_TUNABLES added to GLIBC_TUNABLES (kept where it sets tcache_count itself)."""
    env = dict(environ)
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.tcache_count=" not in tunables:
        env["GLIBC_TUNABLES"] = f"{tunables}:{MALLOC_TUNABLES}" if tunables else MALLOC_TUNABLES
    return env


def retain_freed_memory() -> bool:
    """Tells glibc's malloc to serve every block from the heap and keep freed heap memory; False (and a
    debug log) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, TypeError, AttributeError):
        logger.debug("no mallopt in C library %s: freed host memory goes back to the OS", name)
        return False
    return bool(mallopt(M_MMAP_MAX, MMAP_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def freeze_gc_heap() -> int:
    """Collects once, then moves every object alive (the model, tokenizer and modules loading made) to
    the collector's permanent generation, so the full collections that a step's allocations trigger no
    longer walk them (vLLM does the same after start-up). On SmolLM2 that is about 380k objects, and 2% of
    a 64-sequence decode's CPU time went to walking them. At exit the heap is unfrozen, so what was frozen
    is finalized as usual (frozen, triton's bindings reported their objects leaked). Returns how many
    objects were frozen."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()
