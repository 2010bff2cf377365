"""The host memory a CPU engine sizes its KV cache by: the kernel's MemAvailable, or less where a cgroup v2
limit (a container's, as deploy/ runs it) leaves less; None where neither can be read."""

from __future__ import annotations

import io

import pytest

from sluice.engine.worker import cpu_memory

GIB, MIB = 1 << 30, 1 << 20
MEMINFO = "MemTotal:       16777216 kB\nMemFree:         1048576 kB\nMemAvailable:    8388608 kB\n"


def _files(monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> None:
    def fake_open(path: str, *args, **kwargs) -> io.StringIO:
        if path not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[path])

    monkeypatch.setattr(cpu_memory, "open", fake_open, raising=False)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"/proc/meminfo": MEMINFO}, 8 * GIB),  # no cgroup v2 files: not in a container
        (
            {
                "/proc/meminfo": MEMINFO,
                "/sys/fs/cgroup/memory.max": "max\n",
                "/sys/fs/cgroup/memory.current": "5",
            },
            8 * GIB,
        ),
        (
            {
                "/proc/meminfo": MEMINFO,
                "/sys/fs/cgroup/memory.max": f"{2 * GIB}\n",
                "/sys/fs/cgroup/memory.current": f"{512 * MIB}\n",
            },
            2 * GIB - 512 * MIB,
        ),
        ({"/sys/fs/cgroup/memory.max": f"{GIB}", "/sys/fs/cgroup/memory.current": "0"}, GIB),  # no meminfo
        (
            {
                "/proc/meminfo": MEMINFO,
                "/sys/fs/cgroup/memory.max": "1x",
                "/sys/fs/cgroup/memory.current": "0",
            },
            8 * GIB,
        ),
        ({}, None),
    ],
    ids=["meminfo", "unlimited cgroup", "cgroup limit", "cgroup only", "unreadable limit", "neither"],
)
def test_the_least_of_what_the_kernel_and_the_cgroup_leave(monkeypatch, files, expected) -> None:
    _files(monkeypatch, files)
    assert cpu_memory.available_memory_bytes() == expected
