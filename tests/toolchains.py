"""Where the Go / Java / protoc / buf toolchains are, and a failure that says how to install them.

Tests that need a toolchain fail (never skip) when it is missing: CI installs them before `make test`.
"""

from __future__ import annotations

import os
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUF = os.path.join(REPO, ".tools", "node_modules", ".bin", "buf")
INSTALL_HINT = "install them with `scripts/install_toolchains.sh` (or `make toolchains`), as .ci/run does"


def require(*programs: str) -> None:
    """Fails the test naming every missing program; `buf` means the one in .tools/."""
    missing = []
    for program in programs:
        found = os.access(BUF, os.X_OK) if program == "buf" else shutil.which(program) is not None
        if not found:
            missing.append(program)
    if missing:
        pytest.fail(f"missing toolchain programs {missing}: {INSTALL_HINT}", pytrace=False)
