"""Every module under scripts/ and every benchmark module imports, every `sluice` import in them resolves
(those inside functions too), and every shell script parses: a stale import (such as the
`from sluice.engine import bench` that scripts/gpu_check.py's end-to-end section kept after the layout
change) fails here, not on a GPU machine."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import py_compile
import subprocess
import sys
from pathlib import Path

import paged_batch  # noqa: F401  (first: runs the kernels in the interpreter without CUDA)
import pytest

import sluice.benchmarks

SCRIPTS = Path(__file__).parent.parent / "scripts"
# Modules run by another interpreter than Sluice's: checked for syntax only.
OWN_ENVIRONMENT = ("sluice.benchmarks.engine.llamacpp_runner",)  # llama-cpp-python's own venv
BENCHMARK_MODULES = sorted(
    info.name for info in pkgutil.walk_packages(sluice.benchmarks.__path__, "sluice.benchmarks.")
)


# Imports a script as a module (its `main` stays behind `if __name__ == "__main__"`) in a fresh process with
# TRITON_INTERPRET unset, as on a GPU machine (scripts/compile_kernels.py refuses the interpreter).
_IMPORT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("script_under_test", sys.argv[1])
module = sys.modules["script_under_test"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert callable(module.main)
"""


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_a_script_imports(path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _IMPORT, str(path)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(set(BENCHMARK_MODULES) - set(OWN_ENVIRONMENT)))
def test_a_benchmark_module_imports(name: str) -> None:
    assert importlib.import_module(name).__name__ == name


@pytest.mark.parametrize("name", sorted(OWN_ENVIRONMENT))
def test_a_module_for_another_environment_compiles(name: str) -> None:
    path = Path(sluice.benchmarks.__path__[0]).joinpath(*name.split(".")[2:]).with_suffix(".py")
    py_compile.compile(str(path), doraise=True)


def test_the_gpu_benchmarks_are_found() -> None:
    assert {"sluice.benchmarks.gpu.gpu_benchmarks", "sluice.benchmarks.gpu.serve_checks"} <= set(
        BENCHMARK_MODULES
    )


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.sh")), ids=lambda p: p.name)
def test_a_shell_script_parses(path: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _sluice_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) of every `import sluice...` / `from sluice... import name` in the file, at any depth."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "sluice"]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "sluice"
        ):
            found += [(node.module, alias.name) for alias in node.names]
    return found


SOURCES = sorted(SCRIPTS.glob("*.py")) + sorted(
    path for path in Path(sluice.benchmarks.__path__[0]).rglob("*.py") if "llamacpp_runner" not in path.name
)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_sluice_import_resolves_even_inside_functions(path: Path) -> None:
    for module_name, name in _sluice_imports(path):
        module = importlib.import_module(module_name)
        if name is not None and not hasattr(module, name):
            importlib.import_module(f"{module_name}.{name}")  # a submodule, or ModuleNotFoundError
