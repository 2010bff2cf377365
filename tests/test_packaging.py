"""The distribution installs one import namespace, `sluice`: the design card's top-level folders (engine/,
service/, kernels/, benchmarks/) are its subpackages, the public API is the package root, and nothing named
`engine`, `service` or `kernels` lands on the import path."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _setuptools_table() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    table = _setuptools_table()
    on_disk = []
    for name, folder in table["package-dir"].items():
        for init in sorted((REPO / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(REPO / folder)
            on_disk.append(".".join((name, *relative.parts)))
    assert sorted(table["packages"]) == sorted(on_disk)
    assert {name.split(".")[0] for name in table["packages"]} == {"sluice"}


def test_the_package_root_resolves_its_public_api_lazily() -> None:
    code = (
        "import sys, sluice\n"
        "assert 'torch' not in sys.modules, 'import sluice imported torch'\n"
        "from sluice import Client, AsyncClient, generate_request\n"
        "assert 'torch' not in sys.modules, 'the client imported torch'\n"
        "from sluice import LLM, SamplingParams, EngineConfig\n"
        "assert LLM.__module__ == 'sluice.engine.frontend.llm'\n"
        "missing = [n for n in sluice.__all__ if not hasattr(sluice, n)]\n"
        "assert not missing, missing\n"
        "try:\n"
        "    sluice.NotAThing\n"
        "except AttributeError as e:\n"
        "    assert 'NotAThing' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.expanduser("~"))


def test_the_wheel_in_a_fresh_venv_installs_only_sluice(tmp_path: Path) -> None:
    """`pip install .` into a fresh venv (the dependencies borrowed from this venv's site-packages): the
    public API imports, the C++ kernel sources come along, and the generic names do not come from it.

    The wheel must put no `engine`, `service` or `kernels` on the path; a dependency may (transformers 5
    requires Hugging Face's `kernels` package), so each name is looked for where the wheel installed."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, REPO],
        check=True,
    )
    (wheel,) = wheels.glob("sluice-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], check=True)
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # This venv's dependencies (torch, grpcio, ...), after the new venv's own site-packages.
    deps = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "borrowed_deps.pth").write_text(deps + "\n")
    code = (
        "import importlib.machinery, os, sys\n"
        "from sluice import LLM, SamplingParams, Client\n"
        "import sluice, sluice.engine, sluice.service.cli, sluice.kernels.cpu_extension\n"
        f"assert sluice.__file__.startswith({site!r}), sluice.__file__\n"
        "kernels = os.path.dirname(sluice.kernels.cpu_extension.__file__)\n"
        "assert {'cpu_kernels.cpp', 'cpu_packed_linear.h'} <= set(os.listdir(kernels))\n"
        "for name in ('sluice', 'engine', 'service', 'kernels'):\n"
        f"    spec = importlib.machinery.PathFinder.find_spec(name, [{site!r}])\n"
        "    print(name, 'installed' if spec else 'absent')\n"
    )
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # `sluice` found there shows the lookup works.
    assert result.stdout.splitlines() == [
        "sluice installed",
        "engine absent",
        "service absent",
        "kernels absent",
    ]
    (record,) = Path(site).glob("sluice-*.dist-info/RECORD")
    # Every file the wheel installed into site-packages (the console script goes to ../../../bin).
    top_level = {line.split("/")[0] for line in record.read_text().splitlines() if not line.startswith("..")}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"sluice"}, top_level
    entry_point = subprocess.run([env_dir / "bin" / "sluice", "--help"], capture_output=True, text=True)
    assert entry_point.returncode == 0 and "serve" in entry_point.stdout, entry_point.stderr
