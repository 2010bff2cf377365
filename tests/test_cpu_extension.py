"""`python -m kernels.cpu_extension` (what `make test` and `make serve` run first): every C++ kernel in
`kernels/` built up front, one line each, and a reason instead of a failure where none can be built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_extension

REPO = Path(__file__).resolve().parents[1]


def test_every_kernel_is_listed_and_ready():
    names = cpu_extension.extension_names()
    assert names == sorted(p.stem for p in (REPO / "kernels").glob("*.cpp"))
    assert {"cpu_decoder_stack", "cpu_packed_linear", "cpu_paged_attention"} <= set(names)
    result = subprocess.run(
        [sys.executable, "-m", "kernels.cpu_extension"], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.splitlines() == [f"kernels/{name}.cpp: ready" for name in names]


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "sluice-no-such-compiler")
    cpu_extension._build.cache_clear()
    yield
    monkeypatch.undo()
    cpu_extension._build.cache_clear()


def test_without_a_compiler_each_kernel_reports_why(no_compiler, capsys):
    cpu_extension.main()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(cpu_extension.extension_names())
    assert all(
        line.endswith("no C++ compiler ('sluice-no-such-compiler' not found on PATH)") for line in lines
    )
