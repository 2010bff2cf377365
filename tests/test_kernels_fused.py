"""Fused kernels: rotary + KV-cache store (one kernel) and SiLU-and-mul, each against its PyTorch reference
(and the unfused kernels / transformers' recipe), on random inputs with outputs and caches poisoned."""

from __future__ import annotations

import pytest
import torch
from paged_batch import DEVICE, KERNEL_DTYPES, make_paged_batch, nan_like, tolerance
from transformers.activations import ACT2FN

from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.engine.worker.layers.rotary import build_cos_sin_cache
from sluice.kernels.rotary import rotary_embedding_reference
from sluice.kernels.rotary_store_kv import rotary_store_kv, rotary_store_kv_reference
from sluice.kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference


def _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q, k, v as strided views of one fused qkv projection output, as the model produces them."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(DEVICE, dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k, v


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"), [(4, 1, 32, 16), (6, 2, 16, 32), (3, 3, 24, 16)]
)
def test_rotary_store_kv_equals_rotary_then_store(dtype, num_heads, num_kv_heads, head_dim, block_size):
    positions = torch.tensor([1, 2, 3, 70, 255, 9, 130], device=DEVICE)  # nonzero: every element must move
    num_tokens = len(positions)
    cache = build_cos_sin_cache(head_dim, 256, 500000.0, device=DEVICE)
    qkv, q, k, v = _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    shape = (5, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    slot_mapping = torch.tensor([3, 17, -1, 4 * block_size + 1, 0, -1, 2 * block_size], device=DEVICE)

    ref_qkv = qkv.clone()
    ref_q = ref_qkv[:, : q.shape[1] * head_dim].view_as(q)
    ref_k = ref_qkv[:, q.shape[1] * head_dim : (num_heads + num_kv_heads) * head_dim].view_as(k)
    ref_v = ref_qkv[:, (num_heads + num_kv_heads) * head_dim :].view_as(v)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    expected_q, expected_k = rotary_embedding_reference(positions, q, k, cache)
    v_before = v.clone()

    out_q, out_k = rotary_store_kv(positions, q, k, v, cache, k_cache, v_cache, slot_mapping)
    rotary_store_kv_reference(positions, ref_q, ref_k, ref_v, cache, ref_k_cache, ref_v_cache, slot_mapping)

    assert out_q is q and out_k is k
    torch.testing.assert_close(q, expected_q, **tolerance(dtype))
    torch.testing.assert_close(k, expected_k, **tolerance(dtype))
    torch.testing.assert_close(q, ref_q, **tolerance(dtype))
    assert torch.equal(v, v_before)
    # The cache holds exactly the rotated k (as the kernel left it in k) and v at the mapped slots.
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    stored = slot_mapping >= 0
    assert torch.equal(flat_k[slot_mapping[stored]], k[stored])
    assert torch.equal(flat_v[slot_mapping[stored]], v[stored])
    assert torch.equal(k_cache.isnan(), ref_k_cache.isnan())
    assert torch.equal(v_cache.isnan(), ref_v_cache.isnan())
    written_slots = int(stored.sum())
    assert int((~k_cache.isnan()).all(dim=-1).all(dim=-1).sum()) == written_slots


def test_triton_backend_rotate_and_store_then_attend_equals_rotary_then_forward():
    """The backend's fused path (for the layer seam) against rotary + the torch backend's forward."""
    pairs = [(7, 7), (5, 37), (1, 20)]
    batch = make_paged_batch(
        [q for q, _ in pairs], [s for _, s in pairs], num_heads=8, num_kv_heads=2, head_dim=16, block_size=16
    )
    md = batch.metadata
    positions = torch.cat([torch.arange(s - q, s) for q, s in pairs]).to(DEVICE)
    cache = build_cos_sin_cache(16, 64, 10000.0, device=DEVICE)

    rot_q, rot_k = rotary_embedding_reference(positions, batch.q, batch.k, cache)
    torch_caches = (batch.k_cache.clone(), batch.v_cache.clone())
    expected = TorchAttentionBackend().forward(rot_q, rot_k, batch.v, *torch_caches, md, 0.25)

    backend = TritonAttentionBackend()
    q, k = batch.q.clone(), batch.k.clone()
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    backend.rotate_and_store(positions, q, k, batch.v, cache, k_cache, v_cache, md)
    out = backend.attend(q, k_cache, v_cache, md, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, torch_caches[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache, torch_caches[1])


def _rotary_store_args():
    return {
        "positions": torch.tensor([1, 2]),
        "q": torch.randn(2, 4, 16),
        "k": torch.randn(2, 2, 16),
        "v": torch.randn(2, 2, 16),
        "cos_sin_cache": build_cos_sin_cache(16, 8, 10000.0),
        "k_cache": torch.randn(3, 16, 2, 16),
        "v_cache": torch.randn(3, 16, 2, 16),
        "slot_mapping": torch.tensor([0, 5]),
    }


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("positions", torch.tensor([1.0, 2.0]), "positions: dtype torch.float32"),
        ("q", torch.randn(2, 4, 15), "q: head_dim 15 must be even"),
        ("k", torch.randn(2, 2, 8), "k: expected [2, num_kv_heads, 16]"),
        ("v", torch.randn(2, 1, 16), "v: expected shape (2, 2, 16)"),
        ("k_cache", torch.randn(3, 16, 4, 16), "k_cache: expected [num_blocks, block_size, 2, 16]"),
        ("v_cache", torch.randn(3, 16, 2, 16).half(), "v_cache: dtype torch.float16 must match"),
        ("slot_mapping", torch.tensor([0, 5], dtype=torch.int32), "slot_mapping: dtype torch.int32"),
        ("slot_mapping", torch.tensor([0, 5, 6]), "slot_mapping: expected shape (2,)"),
        ("cos_sin_cache", torch.randn(8, 8), "cos_sin_cache: expected [max_position, 16]"),
    ],
)
def test_rotary_store_kv_rejects_bad_arguments_naming_them(name, bad, message):
    args = _rotary_store_args()
    args[name] = bad
    args = {key: value.to(DEVICE) for key, value in args.items()}
    with pytest.raises(ValueError) as err:
        rotary_store_kv(**args)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("d", [40, 1100])  # one partial column block; two blocks, the second partial
def test_silu_and_mul_equals_the_unfused_recipe(dtype, d):
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(5, 2 * d, generator=gen) * 3).to(DEVICE, dtype)
    out = nan_like(x[:, :d].contiguous())
    result = silu_and_mul(x, out=out)
    assert result is out
    gate, up = x[:, :d], x[:, d:]
    # transformers' LlamaMLP: act_fn(gate_proj(x)) * up_proj(x), each op rounded to the dtype.
    torch.testing.assert_close(out, ACT2FN["silu"](gate) * up, **tolerance(dtype))
    torch.testing.assert_close(out, silu_and_mul_reference(x), **tolerance(dtype))


def test_silu_and_mul_reads_a_strided_input_and_allocates_its_output():
    base = torch.randn(4, 100, device=DEVICE)
    x = base[:, 10:74]  # row stride 100, not 64
    assert not x.is_contiguous()
    out = silu_and_mul(x)
    assert out.shape == (4, 32) and out.is_contiguous()
    torch.testing.assert_close(out, silu_and_mul_reference(x), atol=1e-6, rtol=1e-6)
    assert silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("x", torch.randn(3, 7), "x: last dim must be even"),
        ("x", torch.randn(3, 8).double(), "x: dtype torch.float64"),
        ("x", torch.randn(8, 3).t(), "x: last dim must be contiguous"),
        ("out", torch.randn(3, 3), "out: expected shape (3, 4)"),
        ("out", torch.randn(3, 4).half(), "out: dtype torch.float16 must match"),
    ],
)
def test_silu_and_mul_rejects_bad_arguments_naming_them(name, bad, message):
    args = {"x": torch.randn(3, 8), "out": None}
    args[name] = bad
    args = {key: value.to(DEVICE) if value is not None else None for key, value in args.items()}
    with pytest.raises(ValueError) as err:
        silu_and_mul(**args)
    assert str(err.value).startswith(message)
