"""`python -m sluice.kernels.cpu_extension` (what `make test` and `make serve` run first): every C++ kernel in
`kernels/` built up front (one extension module, a submodule per kernel), one line each, and a reason
instead of a failure where none can be built."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from sluice.kernels import cpu_extension

REPO = Path(__file__).resolve().parents[1]


def test_every_kernel_is_listed_and_ready():
    """One source, kernels/cpu_kernels.cpp, binds every kernel header but the shared ones as a submodule."""
    names = list(cpu_extension.KERNELS)
    shared = {"cpu_team", "cpu_vector_math"}  # included by the kernels, nothing of their own to call
    assert names == sorted({p.stem for p in (REPO / "kernels").glob("cpu_*.h")} - shared)
    assert [p.name for p in (REPO / "kernels").glob("*.cpp")] == ["cpu_kernels.cpp"]
    result = subprocess.run(
        [sys.executable, "-m", "sluice.kernels.cpu_extension"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.splitlines() == [f"kernels/{name}.h: ready" for name in names]
    module = cpu_extension._build()[0]
    submodules = {name for name in dir(module) if isinstance(getattr(module, name), ModuleType)}
    assert submodules == set(names)
    assert cpu_extension.load_cpu_extension("cpu_rms_norm") is module.cpu_rms_norm
    assert callable(module.cpu_rms_norm.rms_norm) and module.cpu_packed_linear.PANEL > 0
    with pytest.raises(
        ValueError, match=r"^name: not a C\+\+ CPU kernel: 'cpu_rmsnorm' \(kernels: cpu_argmax, "
    ):
        cpu_extension.load_cpu_extension("cpu_rmsnorm")


@pytest.fixture
def fresh_builds(monkeypatch):
    """The builds' cache emptied before and after, so a test's settings reach `_build` and go with it."""
    cpu_extension._build.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    cpu_extension._build.cache_clear()


@pytest.fixture
def no_compiler(fresh_builds):
    fresh_builds.setenv("CXX", "sluice-no-such-compiler")


def test_without_a_compiler_each_kernel_reports_why(no_compiler, capsys):
    cpu_extension.main()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(cpu_extension.KERNELS)
    assert all(
        line.endswith("no C++ compiler ('sluice-no-such-compiler' not found on PATH)") for line in lines
    )


def test_an_unwritable_build_directory_is_a_reason_not_a_crash(fresh_builds, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    fresh_builds.setattr(cpu_extension, "BUILD_ROOT", not_a_dir / "cpu_extensions")
    reason = cpu_extension.cpu_extension_unavailable_reason("cpu_rms_norm")
    assert reason is not None and reason.startswith(f"cannot create {not_a_dir / 'cpu_extensions'}")
    assert reason.endswith("set SLUICE_CPU_BUILD_DIR to a writable directory")
    assert cpu_extension.load_cpu_extension("cpu_rms_norm") is None
    with pytest.raises(
        RuntimeError, match=r"^the C\+\+ kernel cpu_rms_norm \(kernels/cpu_rms_norm.h\) is not avail"
    ):
        cpu_extension.require_cpu_extension("cpu_rms_norm")  # what the launchers raise


# A target with 4-float vectors (SSE / NEON), as this machine's native build may not be.
FOUR_LANE_TARGETS = {"x86_64": "x86-64-v2", "aarch64": "armv8-a"}

FOUR_LANE_CHECK = """
import torch
import torch.nn.functional as F
from sluice.kernels import cpu_extension
from sluice.kernels.cpu_packed_linear import pack_weight, packed_linear, panel_width

assert cpu_extension.load_cpu_extension("cpu_packed_linear") is not None
print(cpu_extension._build()[0].__file__)  # the extension module (the kernel is its submodule)
assert panel_width() == 8, panel_width()  # two 4-float vectors
torch.manual_seed(0)
for rows, k, n in [(1, 576, 960), (3, 33, 70), (7, 200, 130), (64, 96, 200)]:
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    y = packed_linear(x, pack_weight(w), n, b)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
"""


def test_a_named_target_builds_apart_and_its_4_lane_vectors_compute_the_same(monkeypatch):
    """SLUICE_CPU_MARCH: the kernels compiled for that target, in a directory named after it. A 4-float
    target runs the vector code's narrowest width (a weight panel's row is 2 of its vectors: 8 columns)."""
    march = FOUR_LANE_TARGETS[platform.machine()]
    monkeypatch.setenv(cpu_extension.MARCH_ENV, march)
    assert cpu_extension._machine_tag().endswith(f"-{march}")
    result = subprocess.run(
        [sys.executable, "-c", FOUR_LANE_CHECK],
        cwd=REPO,
        capture_output=True,
        text=True,
    )  # inherits the target from the environment set above
    assert result.returncode == 0, result.stderr[-2000:]
    built = Path(result.stdout.splitlines()[0])
    assert built.parent.parent.name == cpu_extension._machine_tag()
    monkeypatch.delenv(cpu_extension.MARCH_ENV)
    assert cpu_extension._machine_tag() != built.parent.parent.name  # the native build lives elsewhere


LOAD_IN_A_FRESH_PROCESS = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from sluice.kernels.cpu_extension import load_cpu_extension
print(load_cpu_extension(sys.argv[1]) is not None)
"""


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on(tmp_path):
    """torch's loader waits as long as its `lock` file exists in the build directory, and a process killed
    while building leaves it there: every later engine would hang at start. The holder of Sluice's flock
    removes it. A built kernel copied with such a file loads (nothing to rebuild) and the file is gone."""
    name, tag = "cpu_rms_norm", cpu_extension._machine_tag()
    build = tmp_path / tag / cpu_extension.MODULE
    shutil.copytree(cpu_extension.BUILD_ROOT / tag / cpu_extension.MODULE, build)  # built by `make kernels`
    (build / "lock").write_text("")
    environment = {**os.environ, "SLUICE_CPU_BUILD_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, name],
        env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout == "True\n", result.stderr[-3000:]
    assert f"removing {build / 'lock'}: torch's build lock, left by a build that was killed" in result.stderr
    assert not (build / "lock").exists()
