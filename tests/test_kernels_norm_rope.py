"""Fused RMSNorm (+ residual) and rotary embedding kernels against transformers' Llama modules."""

from __future__ import annotations

import pytest
import torch
from paged_batch import DEVICE, TEST_DTYPES, nan_like, tolerance
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from sluice.engine.loading.model_arch import RopeScaling
from sluice.engine.worker.layers.rotary import build_cos_sin_cache
from sluice.kernels.rms_norm import rms_norm, rms_norm_reference
from sluice.kernels.rotary import rotary_embedding, rotary_embedding_reference

EPS = 1e-5
LLAMA3 = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)


def _hf_norm(weight: torch.Tensor) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.shape[0], eps=EPS).to(device=weight.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize("hidden", [48, 64])
def test_rms_norm_equals_transformers(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype) * 3
    weight = torch.randn(hidden, generator=gen).to(DEVICE, dtype)
    out = nan_like(x)
    normed, residual_out = rms_norm(x, weight, EPS, out=out)
    assert normed is out and residual_out is x
    with torch.no_grad():
        torch.testing.assert_close(normed, _hf_norm(weight)(x), **tolerance(dtype))
    torch.testing.assert_close(normed, rms_norm_reference(x, weight, EPS)[0], **tolerance(dtype))


@pytest.mark.parametrize("dtype", TEST_DTYPES)
def test_rms_norm_fused_residual_add(dtype):
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(5, 40, generator=gen).to(DEVICE, dtype) for _ in range(2))
    weight = torch.randn(40, generator=gen).to(DEVICE, dtype)
    out, residual_out = nan_like(x), nan_like(x)
    rms_norm(x, weight, EPS, residual=residual, out=out, residual_out=residual_out)
    # The unfused model: hidden = residual + x; normed = norm(hidden); hidden is the next residual.
    expected_residual = x + residual
    assert torch.equal(residual_out, expected_residual)
    with torch.no_grad():
        torch.testing.assert_close(out, _hf_norm(weight)(expected_residual), **tolerance(dtype))
    ref_out, ref_residual = rms_norm_reference(x, weight, EPS, residual)
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))
    assert torch.equal(residual_out, ref_residual)


def test_rms_norm_residual_update_in_place():
    x, residual = torch.randn(3, 32, device=DEVICE), torch.randn(3, 32, device=DEVICE)
    weight = torch.randn(32, device=DEVICE)
    expected = rms_norm_reference(x, weight, EPS, residual)
    out, new_residual = rms_norm(x, weight, EPS, residual=residual, residual_out=residual)
    assert new_residual is residual
    assert torch.equal(new_residual, expected[1])
    torch.testing.assert_close(out, expected[0], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("weight", torch.randn(31), "weight: expected shape (32,)"),
        ("residual", torch.randn(4, 32), "residual: expected shape (3, 32)"),
        ("x", torch.randn(3, 32).double(), "x: dtype torch.float64"),
        ("out", torch.randn(3, 32).half(), "out: dtype torch.float16 must match"),
    ],
)
def test_rms_norm_rejects_bad_arguments_naming_them(name, bad, message):
    args = {"x": torch.randn(3, 32), "weight": torch.randn(32), "eps": EPS, "residual": torch.randn(3, 32)}
    args[name] = bad
    args = {key: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for key, v in args.items()}
    with pytest.raises(ValueError) as err:
        rms_norm(**args)
    assert str(err.value).startswith(message)


def _hf_rotary(head_dim: int, scaling: RopeScaling | None) -> LlamaRotaryEmbedding:
    rope_scaling = None
    if scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    config = LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
    )
    return LlamaRotaryEmbedding(config).to(DEVICE)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_cos_sin_cache_equals_transformers(scaling):
    head_dim = 32
    cache = build_cos_sin_cache(head_dim, 256, 500000.0, scaling, device=DEVICE)
    cos, sin = _hf_rotary(head_dim, scaling)(cache, torch.arange(256, device=DEVICE)[None])
    torch.testing.assert_close(cache[:, : head_dim // 2], cos[0, :, : head_dim // 2], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, head_dim // 2 :], sin[0, :, : head_dim // 2], atol=1e-6, rtol=0)
    if scaling is not None:  # the scaling must actually change some frequencies
        assert not torch.allclose(cache, build_cos_sin_cache(head_dim, 256, 500000.0, None, device=DEVICE))


def _qk_views(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q and k as strided views of one fused qkv projection output, as the model produces them."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    return q, k


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 32), (6, 2, 16), (3, 3, 24)])
def test_rotary_in_place_equals_transformers(dtype, num_heads, num_kv_heads, head_dim):
    rotary = _hf_rotary(head_dim, LLAMA3)
    cache = build_cos_sin_cache(head_dim, 256, 500000.0, LLAMA3, device=DEVICE)
    positions = torch.tensor([1, 2, 3, 70, 255, 9, 130], device=DEVICE)  # nonzero: every element must move
    q, k = _qk_views(len(positions), num_heads, num_kv_heads, head_dim, dtype)
    cos, sin = rotary(q.float(), positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.float().transpose(0, 1), k.float().transpose(0, 1), cos, sin)
    ref_q, ref_k = rotary_embedding_reference(positions, q, k, cache)
    out_q, out_k = rotary_embedding(positions, q, k, cache)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q.float(), hf_q[0].transpose(0, 1), **tolerance(dtype))
    torch.testing.assert_close(k.float(), hf_k[0].transpose(0, 1), **tolerance(dtype))
    torch.testing.assert_close(q, ref_q, **tolerance(dtype))
    torch.testing.assert_close(k, ref_k, **tolerance(dtype))


def test_rotary_out_of_place_leaves_inputs_and_fills_outputs():
    cache = build_cos_sin_cache(16, 64, 10000.0, device=DEVICE)
    positions = torch.tensor([0, 5, 63, 17], dtype=torch.int32, device=DEVICE)
    q, k = _qk_views(4, 4, 2, 16, torch.float32)
    q_before, k_before = q.clone(), k.clone()
    out = (nan_like(q.contiguous()), nan_like(k.contiguous()))
    q_out, k_out = rotary_embedding(positions, q, k, cache, inplace=False, out=out)
    assert q_out is out[0] and k_out is out[1]
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    ref_q, ref_k = rotary_embedding_reference(positions, q, k, cache)
    torch.testing.assert_close(q_out, ref_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, ref_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(q_out[0], q[0])  # position 0 is the identity rotation


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("positions", torch.tensor([1.0, 2.0]), "positions: dtype torch.float32"),
        ("positions", torch.tensor([1, 2, 3]), "positions: expected shape (2,)"),
        ("cos_sin_cache", torch.randn(8, 8), "cos_sin_cache: expected [max_position, 16]"),
        ("k", torch.randn(2, 1, 8), "k: expected [2, num_kv_heads, 16]"),
        ("q", torch.randn(2, 2, 15), "q: head_dim 15 must be even"),
    ],
)
def test_rotary_rejects_bad_arguments_naming_them(name, bad, message):
    args = {
        "positions": torch.tensor([1, 2]),
        "q": torch.randn(2, 2, 16),
        "k": torch.randn(2, 1, 16),
        "cos_sin_cache": build_cos_sin_cache(16, 8, 10000.0),
    }
    args[name] = bad
    args = {key: v.to(DEVICE) for key, v in args.items()}
    with pytest.raises(ValueError) as err:
        rotary_embedding(**args)
    assert str(err.value).startswith(message)
