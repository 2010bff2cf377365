"""The Triton backend on an FP8 (e4m3) KV cache: its store kernels write torch's codes, attention reads them.

Kernels: `store_kv` and the fused `rotary_store_kv` must write exactly `fp8_kv_cache.quantize_kv`'s codes
(saturation at +-448, subnormals, ties to even, NaN); the decode (with and without splits) and prefill
kernels over an FP8 cache must equal their PyTorch references on the dequantized cache, in both ways of
applying the scales (`paged_attention_tile`'s FOLD_KV_SCALES). Dequantizing each value (fold False) must
equal, bit for bit, the model-dtype kernels run on that dequantized cache (the only change is the load);
folding the scales into the scores and the output (fold True) skips the rounding of code * scale to the
model dtype, so it is held to the reference's tolerance, and with unit scales (random codes, every value
from the subnormals to +-448) must equal the other path and the model-dtype kernels bit for bit. Scales
0.02 and 3.0 on values ~4x a unit normal make K/V saturate and fall into e4m3's subnormals (checked, not
assumed).
Selector: "auto" on CUDA reads an FP8 cache with triton, never flash-attn. The engine on these kernels:
test_triton_fp8_kv_engine (this file is one of the GPU check's kernel test files).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_batch import DEVICE, KERNEL_DTYPES, PagedBatch, make_paged_batch, nan_like, tolerance
from test_kernels_attention import BACKEND_BATCHES, MIXED, SCALE, GridRecorder, run_triton_and_torch_backends
from test_kernels_sliding_window import WINDOW, _windowed_batch

import sluice.kernels.paged_decode_attention as decode_module
from sluice.benchmarks.gpu import fp8_figures
from sluice.engine.worker.attention import flash_attn_backend
from sluice.engine.worker.attention.fp8_kv_cache import FP8, dequantize_kv, quantize_kv
from sluice.engine.worker.attention.selector import (
    FP8_KV_FLASH_ATTN,
    FP8_KV_TRITON_NOTE,
    get_attention_backend,
)
from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.engine.worker.layers.rotary import build_cos_sin_cache
from sluice.kernels.paged_attention_tile import DEFAULT_FOLD_KV_SCALES, folds_kv_scales
from sluice.kernels.paged_decode_attention import (
    DecodeConfig,
    decode_config,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from sluice.kernels.prefill_attention import PrefillConfig, prefill_attention, prefill_attention_reference
from sluice.kernels.rotary_store_kv import rotary_store_kv
from sluice.kernels.store_kv import store_kv, store_kv_reference

MAGNITUDE = 4.0  # K/V values ~ N(0, 4^2): past 448 * 0.02 = 8.96 sometimes, below 2^-6 * 3.0 sometimes
# (k_scale, v_scale): each of K and V saturates under one pair and falls into subnormals under the other.
SCALES = [(0.02, 3.0), (3.0, 0.02)]
DECODES = [(1, 1), (1, 17), (1, 40), (1, 63), (1, 130)]
LAYOUTS = [(2, 2, 16), (8, 2, 32)]  # (num_heads, num_kv_heads, block_size): GQA 1 and 4, blocks of 16 and 32
SMALL_PREFILL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
SMALL_DECODE = DecodeConfig(tile_n=16, num_warps=4, num_stages=2)
NAN_CODE = 0x7F  # e4m3fn NaN: the poison of a cache the store must leave alone outside its slots
FOLDS = pytest.mark.parametrize("fold", [False, True], ids=["dequantize", "fold"])
UNIT_LAYOUTS = LAYOUTS + [(8, 1, 16), (8, 1, 32)]  # and GQA 8
UNIT_Q_SCALE = 1 / 64  # q shrunk (exactly) for unit-scale codes up to 448, so the softmax is not one-hot
SPLIT_DECODE = {"partition_size": 16, "num_splits": 3, "config": SMALL_DECODE}
UNIT_MAGNITUDE = 32.0  # the tolerance's scale for codes up to 448, ~28x the largest MAGNITUDE values (~16)


def _scales(k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """As the layers hold them: float32 0-dim tensors on the device."""
    return torch.tensor(k_scale, device=DEVICE), torch.tensor(v_scale, device=DEVICE)


def _codes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def _special_values() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours (ties) and one ulp either side of them, values past
    +-448, the subnormal range, zeros, infinities and NaN; both signs, then random values of two sizes."""
    every_code = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = every_code[~every_code.isnan()].unique()
    values = values[values >= 0]
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    extremes = torch.tensor([448.0, 449.0, 464.0, 500.0, 1e6, float("inf"), 2.0**-10, 2.0**-12, 1e-40, 0.0])
    gen = torch.Generator().manual_seed(3)
    rand = torch.cat([torch.randn(1024, generator=gen) * 10, torch.randn(1024, generator=gen) * 0.01])
    signed = torch.cat([values, near, extremes, rand])
    return torch.cat([signed, -signed, torch.tensor([float("nan")])])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("k_scale", [1.0, 0.02, 3.0])
def test_store_kv_writes_torchs_e4m3_codes_bit_for_bit(dtype, k_scale):
    values = _special_values().to(dtype)
    num_kv_heads, head_dim, block_size = 2, 64, 16
    num_tokens = -(-values.numel() // (num_kv_heads * head_dim))
    k = torch.zeros(num_tokens * num_kv_heads * head_dim, dtype=dtype)
    k[: values.numel()] = values
    k = k.view(num_tokens, num_kv_heads, head_dim).to(DEVICE)
    v = k.flip(0)  # other values at each slot, and its own scale
    kv_scales = _scales(k_scale, 2 * k_scale)
    # Tokens go to shuffled slots; every fourth one is a padding row (slot -1), never written.
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-num_tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    slot_mapping = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN_CODE, dtype=torch.uint8, device=DEVICE).view(FP8)
    v_cache = k_cache.clone()

    store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)

    stored = slot_mapping >= 0
    flat_k = _codes(k_cache).view(-1, num_kv_heads, head_dim)
    flat_v = _codes(v_cache).view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slot_mapping[stored]], _codes(quantize_kv(k[stored], kv_scales[0])))
    assert torch.equal(flat_v[slot_mapping[stored]], _codes(quantize_kv(v[stored], kv_scales[1])))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slot_mapping[stored]] = False
    assert (flat_k[untouched] == NAN_CODE).all() and (flat_v[untouched] == NAN_CODE).all()
    # The kernel's reference writes the same codes.
    ref_k, ref_v = torch.full_like(flat_k, NAN_CODE).view(FP8), torch.full_like(flat_v, NAN_CODE).view(FP8)
    store_kv_reference(k, v, ref_k.view(shape), ref_v.view(shape), slot_mapping, kv_scales)
    assert torch.equal(_codes(ref_k), flat_k) and torch.equal(_codes(ref_v), flat_v)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"), [(4, 1, 32, 16), (6, 2, 16, 32)]
)
def test_rotary_store_kv_writes_the_codes_of_the_rotated_k(
    dtype, num_heads, num_kv_heads, head_dim, block_size
):
    positions = torch.tensor([1, 2, 3, 70, 255, 9, 130], device=DEVICE)
    num_tokens = len(positions)
    cos_sin = build_cos_sin_cache(head_dim, 256, 500000.0, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(num_tokens, width, generator=gen) * MAGNITUDE).to(DEVICE, dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    float_q, float_k = q.clone(), k.clone()
    shape = (5, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN_CODE, dtype=torch.uint8, device=DEVICE).view(FP8)
    v_cache = k_cache.clone()
    slot_mapping = torch.tensor([3, 17, -1, 4 * block_size + 1, 0, -1, 2 * block_size], device=DEVICE)
    kv_scales = _scales(0.02, 3.0)

    rotary_store_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slot_mapping, kv_scales)

    # q and k are rotated as with a float cache; the cache holds the codes of k as rotated, and of v.
    float_caches = [torch.empty(shape, dtype=dtype, device=DEVICE) for _ in range(2)]
    rotary_store_kv(positions, float_q, float_k, v, cos_sin, *float_caches, slot_mapping)
    assert torch.equal(q, float_q) and torch.equal(k, float_k)
    stored = slot_mapping >= 0
    flat_k = _codes(k_cache).view(-1, num_kv_heads, head_dim)
    flat_v = _codes(v_cache).view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slot_mapping[stored]], _codes(quantize_kv(k[stored], kv_scales[0])))
    assert torch.equal(flat_v[slot_mapping[stored]], _codes(quantize_kv(v[stored], kv_scales[1])))
    assert int((flat_k != NAN_CODE).all(dim=-1).all(dim=-1).sum()) == int(stored.sum())


def _fp8(
    batch: PagedBatch, k_scale: float, v_scale: float
) -> tuple[PagedBatch, tuple[torch.Tensor, torch.Tensor]]:
    """`batch` (its new K/V already in its caches) scaled by MAGNITUDE, with e4m3 caches: random codes
    everywhere, this step's tokens among them. Checks that some values saturate and some are subnormal."""
    kv_scales = _scales(k_scale, v_scale)
    k_cache = quantize_kv(batch.k_cache * MAGNITUDE, kv_scales[0])
    v_cache = quantize_kv(batch.v_cache * MAGNITUDE, kv_scales[1])
    magnitudes = torch.cat([_codes(k_cache).flatten(), _codes(v_cache).flatten()]) & 0x7F
    assert (magnitudes == 0x7E).any(), "no value saturates at 448"
    assert ((magnitudes > 0) & (magnitudes < 0x08)).any(), "no value is subnormal"
    fp8 = dataclasses.replace(
        batch, k=batch.k * MAGNITUDE, v=batch.v * MAGNITUDE, k_cache=k_cache, v_cache=v_cache
    )
    return fp8, kv_scales


def _batch(pairs, num_heads, num_kv_heads, block_size, dtype=torch.float32):
    batch = make_paged_batch(
        [q for q, _ in pairs], [s for _, s in pairs], num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=16, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    store_kv_reference(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
    return batch


def _tolerance(dtype: torch.dtype, magnitude: float = MAGNITUDE) -> dict[str, float]:
    """paged_batch's tolerance for values `magnitude` times larger (bf16 rounds P and V to 8 bits)."""
    bounds = tolerance(dtype)
    return {"atol": bounds["atol"] * magnitude, "rtol": bounds["rtol"]}


def _dequantized(batch: PagedBatch, kv_scales) -> list[torch.Tensor]:
    """The caches as the kernels dequantize them, tile by tile: `dequantize_kv`'s values, except that
    Triton's interpreter casts float32 to bfloat16 by truncation (numpy has no bfloat16; a GPU rounds to
    nearest even, as torch does), so there bfloat16 caches are truncated alike."""
    dtype, caches = batch.q.dtype, (batch.k_cache, batch.v_cache)
    if dtype != torch.bfloat16 or DEVICE.type == "cuda":
        return [dequantize_kv(cache, scale, dtype) for cache, scale in zip(caches, kv_scales, strict=True)]
    values = [cache.float() * scale for cache, scale in zip(caches, kv_scales, strict=True)]
    return [(v.view(torch.int32) & -65536).view(torch.float32).to(dtype) for v in values]


def _unit_fp8(batch: PagedBatch) -> tuple[PagedBatch, tuple[torch.Tensor, torch.Tensor]]:
    """`batch` with unit scales and e4m3 caches of random codes (any but NaN; NaN where the batch's cache
    is NaN, a freed block), its q shrunk by UNIT_Q_SCALE. Checks that the codes reach +-448 and the
    subnormals."""
    gen = torch.Generator().manual_seed(5)
    caches = []
    for cache in (batch.k_cache, batch.v_cache):
        codes = torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8).to(DEVICE)
        codes = torch.where((codes & 0x7F) == NAN_CODE, codes - 1, codes)
        caches.append(torch.where(cache.isnan(), NAN_CODE, codes).to(torch.uint8).view(FP8))
    magnitudes = torch.cat([_codes(c).flatten() for c in caches]) & 0x7F
    assert (magnitudes == 0x7E).any() and ((magnitudes > 0) & (magnitudes < 0x08)).any()
    unit = dataclasses.replace(batch, q=batch.q * UNIT_Q_SCALE, k_cache=caches[0], v_cache=caches[1])
    return unit, _scales(1.0, 1.0)


def _check_decode(
    batch: PagedBatch, kv_scales, fold, sliding_window=None, magnitude=MAGNITUDE, **kwargs
) -> torch.Tensor:
    """The FP8 decode against its reference and, dequantizing each value (not fold), bit for bit the
    model-dtype kernel on the dequantized cache at the FP8 cache's tile (`decode_config` gives the two
    caches different tiles). Returns the output."""
    md = batch.metadata
    args = (md.block_tables, md.seq_lens, SCALE, md.max_seq_len)
    out = nan_like(batch.q)
    paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, *args, out=out, sliding_window=sliding_window,
        kv_scales=kv_scales, fold_kv_scales=fold, **kwargs,
    )  # fmt: skip
    expected = paged_decode_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, *args[:3], sliding_window, kv_scales
    )
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected, **_tolerance(batch.q.dtype, magnitude))
    if not fold:
        head_dim = batch.q.shape[-1]
        kwargs.setdefault("config", decode_config(head_dim, batch.q.dtype, fp8_kv=True))
        model_dtype = paged_decode_attention(
            batch.q, *_dequantized(batch, kv_scales), *args, out=nan_like(batch.q),
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
        assert torch.equal(out, model_dtype)
    return out


def _check_prefill(
    batch: PagedBatch, kv_scales, fold, sliding_window=None, magnitude=MAGNITUDE, **kwargs
) -> torch.Tensor:
    md = batch.metadata
    args = (md.query_start_loc, md.seq_lens, md.block_tables)
    out = nan_like(batch.q)
    prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, *args, md.max_query_len, SCALE, out=out,
        sliding_window=sliding_window, kv_scales=kv_scales, fold_kv_scales=fold, **kwargs,
    )  # fmt: skip
    expected = prefill_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, *args, SCALE, sliding_window, kv_scales
    )
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected, **_tolerance(batch.q.dtype, magnitude))
    if not fold:
        model_dtype = prefill_attention(
            batch.q, *_dequantized(batch, kv_scales), *args, md.max_query_len, SCALE, out=nan_like(batch.q),
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
        assert torch.equal(out, model_dtype)
    return out


@FOLDS
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), LAYOUTS)
def test_fp8_decode_with_and_without_splits(num_splits, scales, num_heads, num_kv_heads, block_size, fold):
    batch, kv_scales = _fp8(_batch(DECODES, num_heads, num_kv_heads, block_size), *scales)
    _check_decode(batch, kv_scales, fold, partition_size=16, num_splits=num_splits, config=SMALL_DECODE)


@FOLDS
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), LAYOUTS)
def test_fp8_prefill_over_chunks_prefixes_and_decode_rows(
    num_splits, scales, num_heads, num_kv_heads, block_size, fold
):
    """With and without split-KV (each tile's context in up to 3 slices of >= 16 positions, merged)."""
    batch, kv_scales = _fp8(_batch(MIXED, num_heads, num_kv_heads, block_size), *scales)
    _check_prefill(batch, kv_scales, fold, config=SMALL_PREFILL, num_splits=num_splits, partition_size=16)


@FOLDS
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_fp8_decode_and_prefill_in_each_model_dtype_with_the_default_tiles(dtype, fold):
    """Codes are dequantized to the model dtype, as `dequantize_kv` does, before the dots (not fold), or
    enter them as they are, the scales applied to the scores and the output (fold)."""
    decode, kv_scales = _fp8(_batch(DECODES, 8, 2, 16, dtype), *SCALES[0])
    _check_decode(decode, kv_scales, fold)
    prefill, kv_scales = _fp8(_batch(MIXED, 8, 2, 16, dtype), *SCALES[1])
    _check_prefill(prefill, kv_scales, fold)


def test_an_fp8_cache_takes_its_own_decode_tile(monkeypatch):
    """`decode_config`: 64-position tiles over an FP8 cache, 128 over a bf16 one (run 15,
    docs/perf/README.md); the launcher picks the tile by the cache it is given."""
    launches = GridRecorder(decode_module._decode_partition_kernel)
    monkeypatch.setattr(decode_module, "_decode_partition_kernel", launches)
    batch = _batch(DECODES, 8, 2, 16, torch.bfloat16)
    fp8, kv_scales = _fp8(batch, *SCALES[0])
    md = batch.metadata
    for b, scales in ((batch, None), (fp8, kv_scales)):
        paged_decode_attention(
            b.q, b.k_cache, b.v_cache, md.block_tables, md.seq_lens, SCALE, md.max_seq_len, kv_scales=scales
        )
    assert [kwargs["TILE_N"] for kwargs in launches.constexprs] == [128, 64]
    assert decode_config(16, torch.bfloat16, fp8_kv=True) == DecodeConfig(64, 4, 3)


@FOLDS
@pytest.mark.parametrize("block_size", [16, 32])
def test_fp8_sliding_window_skips_the_freed_blocks(block_size, fold):
    """Blocks before each window hold NaN codes (test_kernels_sliding_window's batches): reading one fails."""
    decode, kv_scales = _fp8(
        _windowed_batch([(1, 90), (1, 7), (1, 64), (1, 21)], block_size=block_size), *SCALES[0]
    )
    assert (_codes(decode.k_cache) == NAN_CODE).any()
    _check_decode(decode, kv_scales, fold, WINDOW, partition_size=16, num_splits=3, config=SMALL_DECODE)
    prefill, kv_scales = _fp8(
        _windowed_batch([(30, 30), (5, 70), (1, 90), (40, 75)], block_size=block_size), *SCALES[1]
    )
    _check_prefill(prefill, kv_scales, fold, WINDOW, config=SMALL_PREFILL)


def _check_unit_scales(
    decode: PagedBatch, prefill: PagedBatch, decode_args: dict, prefill_args: dict, sliding_window=None
) -> None:
    """Both paths on unit-scale caches (`_unit_fp8`) of a decode and a prefill batch, each launcher with its
    arguments: equal bit for bit (each also meets the reference; the dequantizing one, the model-dtype
    kernel)."""
    for batch, check, kwargs in (
        (decode, _check_decode, decode_args),
        (prefill, _check_prefill, prefill_args),
    ):
        unit, kv_scales = _unit_fp8(batch)
        outs = [
            check(unit, kv_scales, fold, sliding_window, UNIT_MAGNITUDE, **kwargs) for fold in (False, True)
        ]
        assert torch.equal(*outs)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), UNIT_LAYOUTS)
def test_unit_scales_fold_bit_for_bit_like_dequantizing(dtype, num_heads, num_kv_heads, block_size):
    """With k_scale = v_scale = 1 (`--kv-cache-dtype fp8` without checkpoint scales) both paths attend the
    codes' own values: the same outputs (decode with splits), in GQA 1, 4 and 8, blocks of 16 and 32."""
    _check_unit_scales(
        _batch(DECODES, num_heads, num_kv_heads, block_size, dtype),
        _batch(MIXED, num_heads, num_kv_heads, block_size, dtype),
        SPLIT_DECODE,
        {"config": SMALL_PREFILL},
    )


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_unit_scales_fold_bit_for_bit_like_dequantizing_with_the_default_tiles(dtype):
    _check_unit_scales(_batch(DECODES, 8, 2, 16, dtype), _batch(MIXED, 8, 2, 16, dtype), {}, {})


@pytest.mark.parametrize("block_size", [16, 32])
def test_unit_scales_fold_bit_for_bit_like_dequantizing_in_a_window(block_size):
    _check_unit_scales(
        _windowed_batch([(1, 90), (1, 7), (1, 64), (1, 21)], block_size=block_size),
        _windowed_batch([(30, 30), (5, 70), (1, 90), (40, 75)], block_size=block_size),
        SPLIT_DECODE,
        {"config": SMALL_PREFILL},
        WINDOW,
    )


def test_the_launchers_fold_by_default_and_only_over_an_fp8_cache():
    assert DEFAULT_FOLD_KV_SCALES is True
    assert folds_kv_scales(True, None) and folds_kv_scales(True, True) and not folds_kv_scales(True, False)
    assert not folds_kv_scales(False, None) and not folds_kv_scales(False, True)


@BACKEND_BATCHES
def test_triton_backend_on_an_fp8_cache_equals_the_torch_backend(pairs, block_size):
    """Both backends store the same codes and attend the same dequantized values."""
    batch = make_paged_batch(
        [q for q, _ in pairs],
        [s for _, s in pairs],
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        block_size=block_size,
    )
    kv_scales = _scales(0.02, 3.0)
    results = run_triton_and_torch_backends(
        batch,
        TritonAttentionBackend(32, kv_cache_dtype=FP8, prefill_partition_size=32),
        TorchAttentionBackend(FP8),
        lambda: (quantize_kv(batch.k_cache, kv_scales[0]), quantize_kv(batch.v_cache, kv_scales[1])),
        batch.k * MAGNITUDE,
        batch.v * MAGNITUDE,
        kv_scales,
    )
    (triton_out, *triton_caches), (torch_out, *torch_caches) = results["triton"], results["torch"]
    torch.testing.assert_close(triton_out, torch_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(_codes(triton_caches[0]), _codes(torch_caches[0]))
    assert torch.equal(_codes(triton_caches[1]), _codes(torch_caches[1]))


def test_the_kernels_name_a_missing_or_unwanted_kv_scales():
    batch = _batch([(1, 5), (1, 9)], 4, 2, 16)
    md = batch.metadata
    unit = _scales(1.0, 1.0)
    fp8_k, fp8_v = quantize_kv(batch.k_cache, unit[0]), quantize_kv(batch.v_cache, unit[1])
    decode = (md.block_tables, md.seq_lens, SCALE, md.max_seq_len)
    with pytest.raises(ValueError, match=r"^kv_scales: an FP8 \(torch.float8_e4m3fn\) cache is read with"):
        paged_decode_attention(batch.q, fp8_k, fp8_v, *decode)
    with pytest.raises(ValueError, match=r"^kv_scales: given for a torch.float32 cache; only an FP8"):
        paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, *decode, kv_scales=unit)
    with pytest.raises(
        ValueError, match=r"^kv_scales: v_scale: dtype torch.float16 must match torch.float32$"
    ):
        store_kv(batch.k, batch.v, fp8_k, fp8_v, md.slot_mapping, (unit[0], unit[1].half()))
    with pytest.raises(ValueError, match=r"^kv_scales: k_scale must be a one-element tensor$"):
        prefill_attention(
            batch.q, fp8_k, fp8_v, md.query_start_loc, md.seq_lens, md.block_tables, 1, SCALE,
            kv_scales=(torch.ones(2, device=DEVICE), unit[1]),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: None or torch.float8_e4m3fn, got torch.float16$"):
        TritonAttentionBackend(kv_cache_dtype=torch.float16)


# The selector: decided from names and the package, before any CUDA call, so it runs anywhere.
CUDA = torch.device("cuda")


def test_auto_on_cuda_reads_an_fp8_cache_with_triton_even_where_flash_attn_runs(monkeypatch, caplog):
    for flash_attn_available in (False, True):
        if flash_attn_available:  # as on a GPU with flash_attn installed and a 256-token block
            monkeypatch.setattr(flash_attn_backend, "flash_attn_supports", lambda *args: None)
        caplog.clear()
        with caplog.at_level("INFO", logger="sluice.engine.worker.attention.selector"):
            backend = get_attention_backend(
                "auto", CUDA, block_size=256, dtype=torch.bfloat16, kv_cache_dtype=FP8
            )
        assert isinstance(backend, TritonAttentionBackend) and backend.kv_cache_dtype == FP8
        # The line the GPU check's report looks for in the fp8-KV server's log.
        assert [r.getMessage() for r in caplog.records] == [FP8_KV_TRITON_NOTE]
        assert fp8_figures.TRITON_FP8_KV in FP8_KV_TRITON_NOTE
    named = get_attention_backend("triton", CUDA, block_size=16, dtype=torch.bfloat16, kv_cache_dtype=FP8)
    assert isinstance(named, TritonAttentionBackend) and named.kv_cache_dtype == FP8
    assert get_attention_backend("triton", CUDA, block_size=16, dtype=torch.bfloat16).kv_cache_dtype is None
    with pytest.raises(ValueError) as refused:
        get_attention_backend("flash-attn", CUDA, block_size=256, dtype=torch.bfloat16, kv_cache_dtype=FP8)
    assert str(refused.value) == f"attention_backend: 'flash-attn' cannot run: {FP8_KV_FLASH_ATTN}"
    assert FP8_KV_FLASH_ATTN.startswith("kv_cache_dtype: flash-attn 2 reads bf16/fp16 pages, not an fp8")
