"""How much host memory this process may still take, for sizing what a CPU engine allocates."""

from __future__ import annotations


def available_memory_bytes() -> int | None:
    """Memory this process may still take: the kernel's MemAvailable, or less under a cgroup v2 limit
    (a container's); None where neither can be read (not Linux)."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            limits.append(int(limit) - current)
    except (OSError, ValueError):
        pass
    return min(limits, default=None)
