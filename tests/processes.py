"""Processes as /proc shows them, for tests that kill servers and check what outlives them."""

from __future__ import annotations

from pathlib import Path


def process_running(pid: int) -> bool:
    """Whether process `pid` still runs: gone, or a zombie not yet reaped (what reaps orphans in a container
    differs from machine to machine), is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                children.append(int(entry.name))
    return children
