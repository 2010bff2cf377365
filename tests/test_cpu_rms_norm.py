"""The C++ CPU RMSNorm (residual add fused) against the PyTorch reference (transformers' recipe), with its
outputs poisoned first, and the model's RMSNorm layer taking it on CPU in float32."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.kernels import cpu_extension
from sluice.kernels.cpu_rms_norm import EXTENSION, cpu_rms_norm
from sluice.kernels.rms_norm import rms_norm_reference

EPS = 1e-5


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("hidden", [37, 64, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_equals_reference_and_writes_every_output(rows, hidden, with_residual):
    torch.manual_seed(rows * 7 + hidden)
    x, weight = torch.randn(rows, hidden) * 3, torch.randn(hidden)
    residual = torch.randn(rows, hidden) if with_residual else None
    module = cpu_extension.load_cpu_extension(EXTENSION)
    out = torch.full_like(x, float("nan"))
    residual_out = torch.full_like(x, float("nan")) if with_residual else x
    module.rms_norm(out, residual_out, x, residual, weight, EPS)
    expected, expected_residual = rms_norm_reference(x, weight, EPS, residual)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(residual_out, expected_residual)  # one float add: exact
    launched = cpu_rms_norm(x, weight, EPS, residual)
    torch.testing.assert_close(launched[0], expected, atol=1e-5, rtol=1e-5)
    assert launched[1] is x or with_residual


def test_launcher_names_the_bad_argument():
    x, weight = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match=r"^x: dtype torch.float64"):
        cpu_rms_norm(x.double(), weight, EPS)
    with pytest.raises(ValueError, match=r"^weight: expected shape \(8,\)"):
        cpu_rms_norm(x, torch.randn(9), EPS)
    with pytest.raises(ValueError, match=r"^residual: expected shape \(2, 8\)"):
        cpu_rms_norm(x, weight, EPS, torch.randn(3, 8))


def test_the_layer_uses_the_kernel_on_cpu_float32(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "sluice.engine.worker.layers.norm.cpu_rms_norm_prechecked",
        lambda *args: calls.append(args) or cpu_rms_norm(*args),
    )
    norm = RMSNorm(64, EPS)
    norm.select(KernelConfig(torch.device("cpu"), torch.float32, cpu_kernels=frozenset({EXTENSION})))
    assert norm.implementation == "cpu"
    norm.weight.data.copy_(torch.randn(64))
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    out, residual_out = norm(x, residual)
    expected = rms_norm_reference(x, norm.weight, EPS, residual)
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(residual_out, expected[1]) and len(calls) == 1
