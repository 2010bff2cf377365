"""The C++ CPU rotary and SiLU-and-mul kernels against their PyTorch references (rotary: the Triton
kernel's `rotary_embedding_reference`), and the layers taking them on CPU in float32.

Rotary runs in place on strided q / k views of a fused qkv buffer, as the model calls it: the test
checks the v part of the buffer is left as it was, so a kernel writing past its heads fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.engine.worker.layers.activation import SiluAndMul
from sluice.engine.worker.layers.kernel_config import CPU_LAYER_KERNELS, KernelConfig
from sluice.engine.worker.layers.rotary import RotaryEmbedding, build_cos_sin_cache
from sluice.kernels.cpu_rotary import cpu_rotary_embedding
from sluice.kernels.cpu_silu_and_mul import cpu_silu_and_mul, silu_and_mul_reference
from sluice.kernels.rotary import rotary_embedding_reference

CPU = torch.device("cpu")
CPU_FLOAT32 = KernelConfig(CPU, torch.float32, cpu_kernels=frozenset(CPU_LAYER_KERNELS))
CPU_BFLOAT16 = KernelConfig(CPU, torch.bfloat16)  # other dtypes: no C++ kernel


@pytest.mark.parametrize("num_tokens", [1, 5, 19])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
@pytest.mark.parametrize("positions_dtype", [torch.int64, torch.int32])
def test_rotary_equals_reference_in_place_on_qkv_views(
    num_tokens, num_heads, num_kv_heads, head_dim, positions_dtype
):
    torch.manual_seed(num_tokens * 31 + num_heads)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size)
    original = qkv.clone()
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    table = build_cos_sin_cache(head_dim, 300, 10000.0)
    positions = torch.randint(0, 300, (num_tokens,), dtype=positions_dtype)
    expected_q, expected_k = rotary_embedding_reference(positions, q.clone(), k.clone(), table)
    out_q, out_k = cpu_rotary_embedding(positions, q, k, table)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, expected_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, q_size + kv_size :], original[:, q_size + kv_size :])  # v untouched


def test_rotary_launcher_names_the_bad_argument():
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    table = build_cos_sin_cache(8, 16, 10000.0)
    with pytest.raises(ValueError, match=r"^cos_sin_cache: expected \[max_position, 8\]"):
        cpu_rotary_embedding(torch.zeros(2, dtype=torch.int64), q, k, table[:, :4])
    with pytest.raises(ValueError, match=r"^q: the C\+\+ kernel runs float32 on cpu"):
        cpu_rotary_embedding(torch.zeros(2, dtype=torch.int64), q.bfloat16(), k.bfloat16(), table)
    # The kernel read any row the positions named: past the table another row, 10**9 a SIGSEGV.
    for bad in (16, -3, 10**9):
        with pytest.raises(ValueError, match=r"^positions: must be in \[0, 16\)"):
            cpu_rotary_embedding(torch.tensor([0, bad]), q, k, table)


def test_rotary_embedding_takes_the_kernel_on_cpu_float32(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "sluice.engine.worker.layers.rotary.cpu_rotary_embedding_prechecked",
        lambda *args: calls.append(args[0]) or cpu_rotary_embedding(*args),
    )
    rotary, eager = RotaryEmbedding(16, 64, 10000.0, None), RotaryEmbedding(16, 64, 10000.0, None)
    rotary.select(CPU_FLOAT32)
    eager.select(CPU_BFLOAT16)
    assert (rotary.implementation, eager.implementation) == ("cpu", "native")
    positions = torch.tensor([0, 7, 63])
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    expected = rotary_embedding_reference(positions, q, k, rotary.cos_sin_cache)
    got = rotary(positions)(q.clone(), k.clone())
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1
    got = eager(positions)(q.bfloat16(), k.bfloat16())
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=3e-2)
    assert len(calls) == 1


@pytest.mark.parametrize("rows", [1, 3, 16, 65])
@pytest.mark.parametrize("width", [8, 37, 1536])
def test_silu_and_mul_equals_reference(rows, width):
    torch.manual_seed(rows + width)
    x = torch.randn(rows, 2 * width) * 6  # large |gate| too: both branches of the sigmoid, no overflow
    x[0, 0], x[0, 1] = 100.0, -100.0
    out = cpu_silu_and_mul(x)
    assert out.shape == (rows, width)
    torch.testing.assert_close(out, silu_and_mul_reference(x), atol=1e-5, rtol=1e-5)


def test_silu_and_mul_launcher_names_the_bad_argument():
    with pytest.raises(ValueError, match=r"^x: last dim must be even"):
        cpu_silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"^x: dtype torch.float64"):
        cpu_silu_and_mul(torch.randn(2, 8, dtype=torch.float64))


def test_the_mlp_activation_takes_the_kernel_on_cpu_float32(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "sluice.engine.worker.layers.activation.cpu_silu_and_mul_prechecked",
        lambda x: calls.append(x.shape) or cpu_silu_and_mul(x),
    )
    x = torch.randn(4, 10)
    activation, eager = SiluAndMul(), SiluAndMul()
    activation.select(CPU_FLOAT32)
    eager.select(CPU_BFLOAT16)
    assert (activation.implementation, eager.implementation) == ("cpu", "native")
    torch.testing.assert_close(activation(x), F.silu(x[:, :5]) * x[:, 5:], atol=1e-5, rtol=1e-5)
    assert calls == [(4, 10)]
    assert torch.equal(eager(x.bfloat16()), F.silu(x[:, :5].bfloat16()) * x[:, 5:].bfloat16())
    assert calls == [(4, 10)]  # bf16: PyTorch ops
