"""Which FP8 matmul a layer runs is chosen once, at load, from the device: `torch._scaled_mm` only on CUDA
compute capability 8.9 and up (tested here with the capability given, not with a GPU), the fp32 emulation
elsewhere. The `_scaled_mm` paths' arithmetic (scale layouts, the column-major weight) is checked on CPU,
where torch runs `_scaled_mm` too, against the emulation and against a float reference."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import fp8_layer

from sluice.engine.loading.fp8_config import QUANTIZE_AT_LOAD, Fp8Config, Fp8Group, Fp8Scheme
from sluice.engine.worker.layers.fp8_linear import (
    FP8,
    Fp8LinearMethod,
    quantize_activations,
)
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear import MergedLinear, ReplicatedLinear

CUDA = torch.device("cuda")
PREFIX = "model.layers.0.mlp.gate_up_proj"


def method_on(capability, dtype=torch.bfloat16, sizes=(64, (128, 128)), device=CUDA, fp8=QUANTIZE_AT_LOAD):
    kernels = KernelConfig(device, dtype, quantization="fp8", fp8=fp8, cuda_capability=capability)
    with torch.device("meta"):
        layer = MergedLinear(sizes[0], sizes[1])
        layer.select(kernels, PREFIX)
    return layer.method


@pytest.mark.parametrize(
    ("capability", "dtype", "matmul"),
    [
        ((9, 0), torch.bfloat16, "rowwise"),  # Hopper
        ((8, 9), torch.bfloat16, "rowwise"),  # Ada
        ((10, 0), torch.bfloat16, "rowwise"),
        ((9, 0), torch.float16, "tensorwise"),  # _scaled_mm's row-wise scales want a bf16 output
        ((9, 0), torch.float32, "tensorwise"),
        ((8, 6), torch.bfloat16, "emulated"),  # Ampere: no FP8 tensor cores
        ((8, 0), torch.float16, "emulated"),
    ],
)
def test_scaled_mm_only_on_sm89_and_up(capability, dtype, matmul):
    method = method_on(capability, dtype)
    assert isinstance(method, Fp8LinearMethod) and method.matmul == matmul


def test_emulated_off_cuda_for_odd_sizes_and_weights_only():
    assert method_on(None, torch.float32, device=torch.device("cpu")).matmul == "emulated"
    assert method_on((9, 0), sizes=(64, (120, 128))).matmul == "emulated"  # 248 rows: not a multiple of 16
    assert method_on((9, 0), sizes=(72, (128, 128))).matmul == "emulated"
    weights_only = Fp8Scheme("channel", "none", serialized=True)
    fp8 = Fp8Config(groups=(Fp8Group("weights-only", ("Linear",), weights_only),))
    assert method_on((9, 0), fp8=fp8).matmul == "dequantized"


def test_the_capability_is_read_once_at_load(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: calls.append(device) or (9, 0))
    kernels = KernelConfig.for_model(CUDA, torch.bfloat16, None, "fp8", fp8=QUANTIZE_AT_LOAD)
    assert kernels.cuda_capability == (9, 0) and calls == [CUDA]
    assert KernelConfig.for_model(torch.device("cpu"), torch.float32, None).cuda_capability is None
    with pytest.raises(ValueError, match=r"^fp8: an Fp8Config goes with quantization 'fp8', got None$"):
        KernelConfig(CUDA, torch.bfloat16, fp8=QUANTIZE_AT_LOAD)


def _layer(
    matmul: str, dtype: torch.dtype, activations: str = "token"
) -> tuple[ReplicatedLinear, torch.Tensor]:
    """A 48 -> 32 layer quantized at load (or with a static input scale) running `matmul`, and its float
    weight."""
    weight = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    return fp8_layer(weight, matmul, dtype, activations), weight


@pytest.mark.parametrize(("matmul", "dtype"), [("rowwise", torch.bfloat16), ("tensorwise", torch.float32)])
@pytest.mark.parametrize("activations", ["token", "static"])
def test_the_scaled_mm_paths_compute_what_the_emulation_does(matmul, dtype, activations):
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    fast, weight = _layer(matmul, dtype, activations)
    emulated, _ = _layer("emulated", dtype, activations)
    assert fast.weight.dtype == FP8 and emulated.weight.dtype == torch.float32
    y, expected = fast(x), emulated(x)
    assert y.dtype == expected.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
    torch.testing.assert_close(
        y.float(), expected.float(), rtol=tolerance, atol=tolerance * expected.abs().max()
    )
    # and both are x W^T up to e4m3's 3 mantissa bits on x and W
    reference = x.float() @ weight.T
    assert (expected.float() - reference).abs().max() <= 0.1 * reference.abs().max()


def test_activation_scales():
    x = torch.tensor([[1.0, -448.0, 2.0], [0.0, 0.0, 0.0], [0.5, 0.25, -0.125]])
    x_q, scale = quantize_activations(x, "token")
    assert scale[:, 0].tolist() == pytest.approx([1.0, torch.finfo(torch.float32).tiny, 0.5 / 448])
    assert x_q.dtype == FP8 and x_q[1].float().tolist() == [0.0, 0.0, 0.0]
    assert (x_q.float() * scale)[2].tolist() == pytest.approx([0.5, 0.25, -0.125])
    x_q, scale = quantize_activations(x, "tensor")
    assert scale.tolist() == [[1.0]] and x_q[0].float().tolist() == [1.0, -448.0, 2.0]
    x_q, scale = quantize_activations(x, "static", torch.tensor(0.5))
    assert x_q[0].float().tolist() == [2.0, -448.0, 4.0]  # saturates at -448, never NaN
