"""glibc's malloc told to keep freed activation buffers (engine.core.host_memory)."""

from __future__ import annotations

import ctypes

from engine.core import host_memory


def test_glibc_takes_both_settings():
    assert host_memory.retain_freed_memory() is True


def test_a_c_library_without_mallopt_is_reported_not_raised(monkeypatch):
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert host_memory.retain_freed_memory() is False
