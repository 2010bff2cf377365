"""Host-memory settings of the engine core process.

A CPU step allocates its activations afresh (a prefill chunk's gate/up output is 25 MB on SmolLM2-135M,
the logits of a 256-sequence decode 50 MB). By default glibc serves blocks that big with mmap and hands them
back on free, so every step pays the kernel to fault in and zero its buffers again (docs/BENCHMARKS.md,
"Figures behind the code"). `retain_freed_memory` serves every block from the heap and keeps freed heap
memory for reuse (what vLLM's and IPEX's CPU guides get by preloading tcmalloc or jemalloc), at the cost of
holding on to the peak of a step's temporaries. `freeze_gc_heap` takes what loading left alive out of the
garbage collector's reach.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import logging

logger = logging.getLogger(__name__)

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # free heap top kept up to 1 GiB
# No block is mmap'd. A threshold cannot do it: glibc's largest is 32 MiB, and a bigger block was then
# mapped afresh each step unless the heap happened to hold a free chunk that size (the 50 MB logits of a
# 256-sequence decode: in one process out of two, 12,300 page faults a step).
MMAP_MAX = 0


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
