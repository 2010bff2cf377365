"""`make venv` installs scripts/constraints.txt's versions, so that a clean clone's `make test` runs against
the packages it last passed with, whatever PyPI released since. Every requirement `make venv` installs
(pyproject.toml's own and its dev and fleet extras) needs a pin there that satisfies it; the venv the tests
run in must hold those versions; and the stub generator's pin must be the grpcio-tools that made the
committed stubs (scripts/check_proto.sh compares them byte for byte)."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).parent.parent
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
NOT_PINNED = {"torch"}  # the Makefile's TORCH_SPEC: a CPU build here, another on a GPU machine


def pins() -> dict[str, str]:
    pinned = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        assert version and " " not in line, f"scripts/constraints.txt: {line!r} is not name==version"
        pinned[canonicalize_name(name)] = version
    return pinned


def requirements() -> Iterator[Requirement]:
    """What `pip install -e ".[dev,fleet]"` asks for on this machine (markers evaluated)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for text in [*project["dependencies"], *extras["dev"], *extras["fleet"]]:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            yield requirement


def test_every_requirement_is_pinned_to_a_version_that_satisfies_it() -> None:
    pinned = pins()
    names = set()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        names.add(name)
        if name in NOT_PINNED:
            continue
        assert name in pinned, f"scripts/constraints.txt: no pin for {requirement} (run `make constraints`)"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"scripts/constraints.txt: {name}=={pinned[name]} does not satisfy pyproject.toml's {requirement}"
        )
    assert {"grpcio", "transformers", "xgrammar", "ruff"} <= names  # the file was read


def test_the_venv_holds_the_pinned_versions() -> None:
    """`make venv` installed with the constraints (a venv from before a change to them is rebuilt: the
    Makefile's stamp depends on the file)."""
    wrong = {}
    for name, version in pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # pinned for another platform's dependency
        if installed != version:
            wrong[name] = (installed, version)
    assert wrong == {}, "installed, pinned: run `make venv`"


def test_the_stub_generator_is_the_committed_stubs_version() -> None:
    stubs = (ROOT / "clients" / "python" / "sluice" / "v1" / "sluice_pb2_grpc.py").read_text()
    generated = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", stubs, re.MULTILINE).group(1)
    assert pins()["grpcio-tools"] == generated, "move the pin with `make proto` (pyproject.toml's too)"
