"""store_kv (Triton) and cpu_store_kv (C++, on CPU) write exactly the slots of slot_mapping, skip slot < 0
and touch nothing else; the C++ one raises for a slot past the cache before it writes anything."""

from __future__ import annotations

import pytest
import torch
from paged_batch import DEVICE, TEST_DTYPES, make_paged_batch, nan_like

from sluice.kernels.cpu_paged_attention import cpu_store_kv, cpu_store_kv_prechecked
from sluice.kernels.store_kv import store_kv, store_kv_reference

STORES = [store_kv, cpu_store_kv] if DEVICE.type == "cpu" else [store_kv]


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(1, 16, 16), (2, 32, 32), (3, 24, 16)])
def test_store_kv_writes_exactly_the_mapped_slots(store, dtype, num_kv_heads, head_dim, block_size):
    batch = make_paged_batch(
        [5, 1, 19],
        [5, 40, 30],
        num_heads=num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    slot_mapping = batch.metadata.slot_mapping.clone()
    slot_mapping[[2, 7]] = -1  # padding rows: must not be written anywhere
    slot_mapping[11] = -7  # any negative slot is padding
    k_cache, v_cache = nan_like(batch.k_cache), nan_like(batch.v_cache)
    store(batch.k, batch.v, k_cache, v_cache, slot_mapping)

    expected_k, expected_v = nan_like(batch.k_cache), nan_like(batch.v_cache)
    store_kv_reference(batch.k, batch.v, expected_k, expected_v, slot_mapping)
    assert torch.equal(k_cache.isnan(), expected_k.isnan())
    assert torch.equal(v_cache.isnan(), expected_v.isnan())
    assert torch.equal(k_cache.nan_to_num(), expected_k.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), expected_v.nan_to_num())
    # Direct check of the layout: token t lands at [slot // block_size, slot % block_size].
    for token in (0, 6, 24):
        slot = int(slot_mapping[token])
        assert torch.equal(k_cache[slot // block_size, slot % block_size], batch.k[token])
        assert torch.equal(v_cache[slot // block_size, slot % block_size], batch.v[token])
    written_slots = int((slot_mapping >= 0).sum())
    assert int((~k_cache.isnan()).all(dim=-1).all(dim=-1).sum()) == written_slots


@pytest.mark.parametrize("store", STORES)
def test_store_kv_reads_strided_views_of_a_fused_projection(store):
    num_tokens, num_kv_heads, head_dim, block_size = 6, 2, 16, 16
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim, device=DEVICE)
    k = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    k_cache = torch.full((4, block_size, num_kv_heads, head_dim), float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    slot_mapping = torch.tensor([3, 17, 18, 63, 0, 40], dtype=torch.int64, device=DEVICE)
    store(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping], k)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping], v)


def _args():
    k = torch.randn(4, 2, 16, device=DEVICE)
    cache = torch.randn(3, 16, 2, 16, device=DEVICE)
    slots = torch.arange(4, dtype=torch.int64, device=DEVICE)
    return {"k": k, "v": k.clone(), "k_cache": cache, "v_cache": cache.clone(), "slot_mapping": slots}


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("slot_mapping", torch.arange(4, dtype=torch.int32), "slot_mapping: dtype torch.int32"),
        ("slot_mapping", torch.arange(5, dtype=torch.int64), "slot_mapping: expected shape (4,)"),
        ("k_cache", torch.randn(3, 16, 4, 16), "k_cache: expected [num_blocks, block_size, 2, 16]"),
        ("v_cache", torch.randn(3, 16, 2, 16).half(), "v_cache: dtype torch.float16 must match"),
        ("v", torch.randn(4, 2, 8), "v: expected shape (4, 2, 16)"),
        ("k", torch.randn(4, 16, 2).transpose(1, 2), "k: last dim must be contiguous"),
        ("k_cache", torch.randn(16, 2, 16), "k_cache: expected 4 dims"),
    ],
)
@pytest.mark.parametrize("store", STORES)
def test_store_kv_rejects_bad_arguments_naming_them(store, name, bad, message):
    args = _args()
    args[name] = bad.to(DEVICE)
    with pytest.raises(ValueError) as err:
        store(**args)
    assert str(err.value).startswith(message)


PAST_THE_CACHE = [([0, 1, 48, 2], 48, 2), ([5, -1, 9, 1000], 1000, 3)]  # (slots, first bad slot, its token)


@pytest.mark.parametrize("store", [cpu_store_kv, cpu_store_kv_prechecked])
@pytest.mark.parametrize(("slots", "bad_slot", "bad_token"), PAST_THE_CACHE)
def test_cpu_store_kv_rejects_a_slot_past_the_cache_naming_it_and_writes_nothing(
    store, slots, bad_slot, bad_token
):
    """Also through the prechecked entry point (the other layers of a step), and with nothing written for
    the good slots before the bad one: the kernel checks every slot first, and the error is raised in
    Python, not thrown from C++ (a JIT-built extension died with SIGSEGV there on a GPU machine)."""
    args = {name: tensor.cpu() for name, tensor in _args().items()}
    args["slot_mapping"] = torch.tensor(slots)  # 3 blocks of 16: slots 0-47
    args["k_cache"], args["v_cache"] = nan_like(args["k_cache"]), nan_like(args["v_cache"])
    message = rf"slot_mapping: slot {bad_slot} \(token {bad_token}\) is past the cache's 48 slots"
    with pytest.raises(RuntimeError, match=message):
        store(**args)
    assert args["k_cache"].isnan().all() and args["v_cache"].isnan().all()
