"""deploy/Dockerfile's `--build-arg EXTRAS=gpu` (flash-attn): flash-attn ships only an sdist whose setup.py
imports torch, packaging and wheel at its top, so pip's isolated build environment (a fresh one holding only
setuptools) fails it with "No module named 'torch'" whatever torch the image holds; its setup.py also runs
nvcc, which only a -devel CUDA base image has. The Dockerfile's pip commands run here under sh with `pip`
and `python` recorded instead of run."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from toolchains import REPO

DOCKERFILE = os.path.join(REPO, "deploy", "Dockerfile")
SEP = "\x1f"
# What flash-attn's setup.py imports before its setup() call, besides the standard library (2.8.3).
FLASH_ATTN_SETUP_IMPORTS = {"torch", "packaging", "wheel", "setuptools"}


def _text() -> str:
    with open(DOCKERFILE) as f:
        return f.read()


def _instructions() -> list[tuple[str, str]]:
    lines = [line.strip() for line in _text().splitlines()]
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in lines if not line.startswith("#")))
    return [tuple(line.split(None, 1)) for line in joined.splitlines() if line.strip()]


def pip_calls(extras: str) -> list[list[str]]:
    """The argument lists of every `pip` the Dockerfile's RUN instructions call, EXTRAS set to `extras`."""
    instructions = _instructions()
    args = dict(rest.split("=", 1) for name, rest in instructions if name == "ARG" and "=" in rest)
    runs = [rest for name, rest in instructions if name == "RUN" and "pip " in rest]
    stubs = f'pip() {{ printf "%s{SEP}" "$@" >> "$LOG"; echo >> "$LOG"; }}; python() {{ :; }}'
    env = {k: v.strip('"') for k, v in args.items()} | {"EXTRAS": extras, "PATH": os.environ["PATH"]}
    calls: list[list[str]] = []
    for run in runs:
        log = subprocess.run(
            ["sh", "-c", f'LOG=$(mktemp); {stubs}; {run}; cat "$LOG"; rm "$LOG"'],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        calls += [line.split(SEP)[:-1] for line in log.splitlines() if line]
    return calls


def _requirement_names(call: list[str]) -> set[str]:
    return {
        re.split(r"[<>=\[ ]", arg.strip('"'), maxsplit=1)[0] for arg in call[1:] if not arg.startswith("-")
    }


@pytest.mark.parametrize("extras", ["gpu", ""])
def test_the_project_installs_after_torch(extras: str) -> None:
    calls = pip_calls(extras)
    (project,) = [i for i, call in enumerate(calls) if any(arg.startswith(".") for arg in call)]
    assert calls[project][-1] == (f".[{extras}]" if extras else ".")
    assert any("torch" in _requirement_names(call) for call in calls[:project])


def test_extras_build_against_the_image_torch_without_build_isolation() -> None:
    calls = pip_calls("gpu")
    (project,) = [i for i, call in enumerate(calls) if ".[gpu]" in call]
    assert "--no-build-isolation" in calls[project], calls[project]
    installed_before = set().union(*(_requirement_names(call) for call in calls[:project]))
    assert installed_before >= FLASH_ATTN_SETUP_IMPORTS, FLASH_ATTN_SETUP_IMPORTS - installed_before


def test_the_gpu_extra_is_documented_with_a_devel_base_image() -> None:
    """flash-attn's setup.py runs `$CUDA_HOME/bin/nvcc -V` before it fetches a prebuilt wheel or compiles."""
    header = "\n".join(line for line in _text().splitlines() if line.startswith("#"))
    example = re.search(r"--build-arg EXTRAS=gpu[^.]*?--build-arg CUDA_IMAGE=(\S+)", header)
    assert example and re.fullmatch(r"nvidia/cuda:[\d.]+-devel-ubuntu24\.04", example.group(1)), header
