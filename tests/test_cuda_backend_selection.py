"""Choosing the CUDA attention backends: safe to import anywhere, clear errors where they cannot run."""

from __future__ import annotations

import paged_batch  # noqa: F401  (first: runs the kernels in the interpreter without CUDA)
import pytest
import torch

from sluice.engine.worker.attention.flash_attn_backend import (
    FlashAttnBackend,
    flash_attn_installed,
    flash_attn_supports,
)
from sluice.engine.worker.attention.selector import get_attention_backend

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only named, never used: these checks run before any CUDA call


def test_auto_off_cuda_is_the_cpu_kernel():
    assert get_attention_backend("auto", CPU, block_size=256, dtype=torch.bfloat16).name == "cpu"


def test_triton_off_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        ValueError, match=r"^attention_backend: 'triton' needs a CUDA device .* device is 'cpu'"
    ):
        get_attention_backend("triton", CPU)


def test_triton_on_cpu_runs_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attention_backend("triton", CPU).name == "triton"
    assert get_attention_backend("auto", CPU).name == "cpu"  # auto never picks the slow interpreter


def test_flash_attn_off_cuda_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"^attention_backend: 'flash-attn' cannot run: device: flash-attn needs a CUDA"
    ):
        get_attention_backend("flash-attn", CPU)
    with pytest.raises(ValueError, match="^device: flash-attn needs a CUDA device, got 'cpu'$"):
        FlashAttnBackend(CPU)


def test_flash_attn_limits_are_named():
    if not flash_attn_installed():
        assert flash_attn_supports(CUDA, 256, torch.bfloat16) == (
            "attention_backend: the flash_attn package is not installed (pip install 'sluice[gpu]')"
        )
        return
    assert flash_attn_supports(CUDA, 256, torch.bfloat16) is None
    assert (
        flash_attn_supports(CUDA, 16, torch.bfloat16)
        == "block_size: flash-attn needs a multiple of 256, got 16"
    )
    assert (
        flash_attn_supports(CUDA, 256, torch.float32)
        == "dtype: flash-attn needs float16 or bfloat16, got torch.float32"
    )


def test_unknown_backend_name():
    with pytest.raises(
        ValueError,
        match="^attention_backend: unknown 'xformers'; supported: auto, torch, cpu, triton, flash-attn$",
    ):
        get_attention_backend("xformers", CPU)
