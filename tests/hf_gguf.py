"""transformers' tokenizer and model of a GGUF file (the reference the packaged-model tests compare with),
from one parse of the file.

transformers reads a GGUF file with gguf-py's `GGUFReader` for the tokenizer, again for the config and
again for the weights, and each read parses every metadata field: for Gemma 3's 262,144-token vocabulary
~17 s on a 2-core machine. While `hf_gguf` loads, `gguf.GGUFReader` hands back one reader of the file;
transformers' own code does everything else as it would. That reader slices the file's memory map as a plain
ndarray: `np.memmap`'s Python-level `__getitem__` and `__array_finalize__`, run for each of the ~800k
items the reader parses, took two thirds of its time (Gemma 3's file: 17.5-18.0 s -> 6.0-6.9 s). Its
arrays are the same read-only bytes of the mapped file.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch


class _PlainArrayReader(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain-ndarray view of its memory map (the file stays mapped)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)


def hf_gguf(path: str):
    """(tokenizer, float32 model in eval mode) as transformers loads them from the GGUF file `path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(path)
    read = gguf.GGUFReader
    reader = _PlainArrayReader(path)

    def one_reader(file: os.PathLike[str] | str, mode: str = "r") -> gguf.GGUFReader:
        return reader if mode == "r" and os.path.samefile(file, path) else read(file, mode)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", one_reader)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return tokenizer, model.eval()
