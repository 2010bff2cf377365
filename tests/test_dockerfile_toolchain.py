"""deploy/Dockerfile installs the compilers the server runs at first use: gcc for Triton's launchers, and
the C++ compiler the CPU kernels build with (`c++`, unless CXX names another), which Debian and Ubuntu ship
in g++, not gcc. Without it a CPU run of the image (the observability compose file without its GPU
override) serves on the slower torch fallback, with a warning per kernel."""

from __future__ import annotations

import os
import re

from toolchains import REPO

DOCKERFILE = os.path.join(REPO, "deploy", "Dockerfile")
# The package that provides each compiler command on Debian/Ubuntu (`dpkg -S`, update-alternatives).
PROVIDES = {"gcc": "gcc", "c++": "g++", "g++": "g++"}


def apt_packages(text: str) -> set[str]:
    """The packages of every `apt-get install` in the Dockerfile (options dropped)."""
    text = text.replace("\\\n", " ")
    packages: set[str] = set()
    for command in re.findall(r"apt-get install ([^&;\n]*)", text):
        packages |= {word for word in command.split() if not word.startswith("-")}
    return packages


def test_the_image_has_the_compilers_the_server_builds_with_at_first_use() -> None:
    with open(DOCKERFILE) as f:
        text = f.read()
    packages = apt_packages(text)
    cxx = re.search(r"^ENV .*\bCXX=(\S+)", text, re.M)
    compiler = cxx.group(1) if cxx else "c++"  # kernels/cpu_extension.py: os.environ.get("CXX", "c++")
    with open(os.path.join(REPO, "kernels", "cpu_extension.py")) as f:
        assert 'os.environ.get("CXX", "c++")' in f.read()
    assert PROVIDES["gcc"] in packages, packages
    assert PROVIDES[os.path.basename(compiler)] in packages, (compiler, packages)
