"""glibc's malloc told to keep freed activation buffers, and the loaded heap frozen for the garbage collector
(sluice.engine.process.host_memory)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

from sluice.engine.process import host_memory
from sluice.engine.process.threads import core_process_environment

REPO = Path(__file__).resolve().parents[1]


REUSE_CHECK = """
import resource
import torch
from sluice.engine.process.host_memory import retain_freed_memory

def faults_of_a_fresh_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(64 << 20, dtype=torch.uint8)  # over glibc's largest mmap threshold (32 MiB)
    block.fill_(1)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

assert retain_freed_memory() is True
first = faults_of_a_fresh_block()
for _ in range(3):  # torch's blocks may alternate between two places in the heap: touch both first
    faults_of_a_fresh_block()
print(first, sum(faults_of_a_fresh_block() for _ in range(6)))
"""


def test_a_freed_block_of_any_size_is_reused_not_faulted_in_again():
    # in a child started as the engine core is (glibc's tunables are read at start): the settings hold for
    # the rest of the process
    env = core_process_environment(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", REUSE_CHECK], cwd=REPO, capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    first, six_more = map(int, result.stdout.split())
    # Mapped afresh, the 64 MiB block faults in 16,384 pages each time (32 with transparent huge pages).
    assert max(six_more, 1) * 10 <= first, (first, six_more)


def test_a_c_library_without_mallopt_is_reported_not_raised(monkeypatch):
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert host_memory.retain_freed_memory() is False


FREEZE_CHECK = """
import atexit, gc, weakref
from sluice.engine.process.host_memory import freeze_gc_heap

atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count()))  # runs after the ones made later

class Node:
    pass

alive, cycle = Node(), Node()
cycle.self = cycle  # garbage only a collection frees
dead = weakref.ref(cycle)
del cycle
frozen = freeze_gc_heap()
assert dead() is None, "the garbage was frozen instead of collected"
assert frozen == gc.get_freeze_count() > 0
assert not any(o is alive for o in gc.get_objects()), "a live object is still in the collected generations"
"""


def test_freezing_collects_the_garbage_takes_the_rest_out_of_collections_until_exit():
    # in a child: a frozen heap stays frozen for the rest of the process
    result = subprocess.run([sys.executable, "-c", FREEZE_CHECK], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["frozen at exit: 0"]  # unfrozen first, so finalized as usual
