"""`sluice.kernels.fp8_gemv`: the FP8 linear for decode-sized batches, against the emulated product of
`fp8_linear.quantize_activations` (its plain PyTorch version) on the same e4m3 weight.

The codes and scales are `fp8_quant`'s, bit for bit (tests/test_kernels_fp8_quant.py); what may differ
here is the order of the fp32 sums, so a float32 y is compared at a few fp32 ulps and a bf16/fp16 y at one
ulp of its dtype (the interpreter also rounds fp32 -> bf16 by truncation, a GPU to nearest).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
from fp8_checkpoints import fp8_layer
from paged_batch import DEVICE, KERNEL_DTYPES

from sluice.engine.worker.layers import fp8_linear
from sluice.engine.worker.layers.fp8_linear import (
    GEMV_MAX_ROWS,
    quantize_activations,
    quantize_weight,
    runs_gemv,
)
from sluice.kernels.fp8_gemv import MAX_ROWS, GemvConfig, fp8_gemv, gemv_config

STATIC_SCALE = 0.02


def _inputs(num_rows, out_features, in_features, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_rows, in_features, generator=gen) * 3).to(dtype)
    weight, weight_scale = quantize_weight(torch.randn(out_features, in_features, generator=gen))
    return x.to(DEVICE), weight.to(DEVICE), weight_scale.to(DEVICE)


def _expected(x, weight, weight_scale, input_scale=None):
    """The emulated path's y in float32 (quantized on CPU, where the division is IEEE-exact)."""
    activations = "token" if input_scale is None else "static"
    scale = None if input_scale is None else input_scale.cpu()
    x_q, x_scale = quantize_activations(x.cpu(), activations, scale)
    y = torch.mm(x_q.float(), weight.cpu().float().t())
    return y * x_scale * weight_scale.cpu()


def _assert_close(y, expected):
    expected = expected.to(y.device)
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        return
    ulp = torch.finfo(y.dtype).eps * expected.abs().clamp(min=torch.finfo(y.dtype).tiny)
    assert bool(((y.float() - expected).abs() <= 2 * ulp + 1e-30).all()), (y.float() - expected).abs().max()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    ("num_rows", "out_features", "in_features"),
    [(1, 48, 64), (2, 100, 200), (3, 40, 300), (MAX_ROWS, 32, 48)],
)
def test_per_token_y_is_the_emulated_product(dtype, num_rows, out_features, in_features):
    x, weight, weight_scale = _inputs(num_rows, out_features, in_features, dtype)
    y = fp8_gemv(x, weight, weight_scale, config=GemvConfig(block_n=16, block_k=64))
    assert y.shape == (num_rows, out_features) and y.dtype == dtype
    _assert_close(y, _expected(x, weight, weight_scale))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("input_scale_shape", [(), (1,)])
def test_a_static_scale_quantizes_every_row_with_it(dtype, input_scale_shape):
    x, weight, weight_scale = _inputs(5, 64, 80, dtype, seed=1)
    x[2, 7] = 100.0  # saturates at 448 * STATIC_SCALE
    input_scale = torch.full(input_scale_shape, STATIC_SCALE, device=DEVICE)
    y = fp8_gemv(x, weight, weight_scale, input_scale, config=GemvConfig(block_n=32, block_k=64))
    _assert_close(y, _expected(x, weight, weight_scale, input_scale))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("split_k", [1, 2])
def test_a_capped_amax_quantizes_as_quantize_activations_caps_it(dtype, split_k):
    """fbgemm_fp8's scale_ub: rows whose amax passes the cap take cap / 448 as their scale and saturate."""
    x, weight, weight_scale = _inputs(3, 64, 96, dtype, seed=2)
    x[0] *= 10.0  # ~30: past the cap of 5; rows 1 and 2 (~9) are capped too unless scaled down
    x[2] *= 0.1  # ~0.9: below it
    config = GemvConfig(block_n=32, block_k=32, split_k=split_k)
    y = fp8_gemv(x, weight, weight_scale, config=config, scale_ub=5.0)
    x_q, x_scale = quantize_activations(x.cpu(), "token", scale_ub=5.0)
    cap_scale = torch.tensor([5.0]) / 448
    assert torch.equal(x_scale[0], cap_scale) and x_scale[2].item() < cap_scale.item()
    expected = torch.mm(x_q.float(), weight.cpu().float().t()) * x_scale * weight_scale.cpu()
    _assert_close(y, expected)
    assert not torch.allclose(y.float().cpu(), _expected(x, weight, weight_scale).float(), rtol=0.05)
    with pytest.raises(ValueError, match="^scale_ub: caps per-token scales, not with an input_scale"):
        fp8_gemv(x, weight, weight_scale, torch.tensor(0.1, device=DEVICE), scale_ub=5.0)
    with pytest.raises(ValueError, match="^scale_ub: must be a positive finite float, got -1.0"):
        fp8_gemv(x, weight, weight_scale, scale_ub=-1.0)


@pytest.mark.parametrize(
    "config", [GemvConfig(1, 16, 1), GemvConfig(4, 64, 2), GemvConfig(64, 256), GemvConfig()]
)
def test_every_tile_gives_the_same_y(config):
    """Tiles narrower and wider than the layer, K not a multiple of the tile."""
    x, weight, weight_scale = _inputs(4, 72, 136, torch.float32, seed=2)
    y = fp8_gemv(x, weight, weight_scale, config=config)
    _assert_close(y, _expected(x, weight, weight_scale))


@pytest.mark.parametrize("input_scale", [None, STATIC_SCALE])
@pytest.mark.parametrize(("num_rows", "block_k"), [(1, 32), (3, 64), (MAX_ROWS, 128)])
def test_prefetched_or_pipelined_tiles_give_the_same_y_bit_for_bit(input_scale, num_rows, block_k):
    """K = 200: 4-7 tiles, the last partial; the tile asked for past the end is all masked."""
    x, weight, weight_scale = _inputs(num_rows, 40, 200, torch.bfloat16, seed=5)
    scale = None if input_scale is None else torch.tensor(input_scale, device=DEVICE)
    plain = fp8_gemv(x, weight, weight_scale, scale, config=GemvConfig(16, block_k))
    prefetched = fp8_gemv(x, weight, weight_scale, scale, config=GemvConfig(16, block_k, prefetch=True))
    assert torch.equal(prefetched, plain)
    pipelined = fp8_gemv(x, weight, weight_scale, scale, config=GemvConfig(16, block_k, stages=3))
    assert torch.equal(pipelined, plain)
    _assert_close(prefetched, _expected(x, weight, weight_scale, scale))


@pytest.mark.parametrize(("num_rows", "amax_k"), [(1, 16), (1, 512), (3, 256), (MAX_ROWS, 64)])
def test_a_wider_or_narrower_amax_pass_gives_the_same_y_bit_for_bit(num_rows, amax_k):
    """K = 200 in 32-column product tiles; the amax pass in steps of 16 (narrower) to 512 columns (one
    step past K) a row. The largest |x| of the first row in its last column, a NaN in the second row's."""
    x, weight, weight_scale = _inputs(num_rows, 24, 200, torch.bfloat16, seed=9)
    x[0, 199] = -40.0
    if num_rows > 1:
        x[1, 198] = float("nan")
    block_m = triton.next_power_of_2(num_rows)
    tile = GemvConfig(8, 32 * block_m)
    plain = fp8_gemv(x, weight, weight_scale, config=tile)
    for prefetch in (False, True):
        config = replace(tile, amax_k=amax_k * block_m, prefetch=prefetch)
        y = fp8_gemv(x, weight, weight_scale, config=config)
        torch.testing.assert_close(y, plain, rtol=0, atol=0, equal_nan=True)
    assert num_rows == 1 or bool(y[1].isnan().all())
    rows = [row for row in range(num_rows) if row != 1]
    _assert_close(y[rows], _expected(x[rows], weight, weight_scale))


@pytest.mark.parametrize(
    ("split_k", "num_rows", "input_scale"),
    [(2, 1, None), (4, 3, STATIC_SCALE), (8, 2, None), (8, MAX_ROWS, STATIC_SCALE), (16, MAX_ROWS, None)],
)
def test_split_k_sums_the_splits_to_the_emulated_product(split_k, num_rows, input_scale):
    """K = 300 in 64-column tiles (one row): 5 tiles over 2-16 splits, so some splits get 1 tile, the last
    a partial one, and at 8 and 16 some get none; N = 72 is not a multiple of block_n. Prefetched tiles
    change nothing there either, bit for bit."""
    x, weight, weight_scale = _inputs(num_rows, 72, 300, torch.float32, seed=6)
    scale = None if input_scale is None else torch.tensor(input_scale, device=DEVICE)
    config = GemvConfig(16, 64 * triton.next_power_of_2(num_rows), split_k=split_k)
    y = fp8_gemv(x, weight, weight_scale, scale, config=config)
    assert y.shape == (num_rows, 72) and y.dtype == torch.float32
    _assert_close(y, _expected(x, weight, weight_scale, scale))
    assert torch.equal(fp8_gemv(x, weight, weight_scale, scale, config=replace(config, prefetch=True)), y)


def test_split_k_and_prefetch_read_a_row_strided_x():
    """x a column window of a wider buffer (row stride 100, K = 70 in 16-column tiles, 5 tiles over 4
    splits); N = 20 is not a multiple of block_n."""
    x, weight, weight_scale = _inputs(2, 20, 70, torch.bfloat16, seed=8)
    wide = torch.full((2, 100), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    wide[:, 20:90] = x
    config = GemvConfig(8, 32, split_k=4)
    y = fp8_gemv(wide[:, 20:90], weight, weight_scale, config=config)
    _assert_close(y, _expected(x, weight, weight_scale))
    prefetched = replace(config, prefetch=True)
    assert torch.equal(fp8_gemv(wide[:, 20:90], weight, weight_scale, config=prefetched), y)


def test_split_k_keeps_a_nan_row_to_itself_and_writes_bf16():
    x, weight, weight_scale = _inputs(3, 48, 256, torch.bfloat16, seed=7)
    x[2, 200] = float("nan")  # in the last split's columns: every split's amax sees it
    y = fp8_gemv(x, weight, weight_scale, config=GemvConfig(16, 32, split_k=4))
    assert y.dtype == torch.bfloat16 and bool(y[2].isnan().all()) and not bool(y[:2].isnan().any())
    _assert_close(y[:2], _expected(x[:2], weight, weight_scale))


def test_row_strided_x():
    x, weight, weight_scale = _inputs(6, 32, 64, torch.float32, seed=3)
    wide = torch.zeros(6, 100, device=DEVICE)
    wide[:, 10:74] = x
    y = fp8_gemv(wide[:, 10:74], weight, weight_scale, config=GemvConfig(16, 64))
    _assert_close(y, _expected(x, weight, weight_scale))


def test_a_nan_in_a_row_makes_that_row_nan_only():
    x, weight, weight_scale = _inputs(3, 32, 64, torch.float32, seed=4)
    x[1, 5] = float("nan")
    y = fp8_gemv(x, weight, weight_scale, config=GemvConfig(16, 64))
    assert bool(y[1].isnan().all()) and not bool(y[[0, 2]].isnan().any())
    _assert_close(y[[0, 2]], _expected(x[[0, 2]], weight, weight_scale))


def test_no_rows_launch_nothing():
    x, weight, weight_scale = _inputs(0, 32, 64, torch.float32)
    assert fp8_gemv(x, weight, weight_scale).shape == (0, 32)


def test_the_default_tile_is_the_sweeps_on_its_shapes_and_the_rule_elsewhere():
    assert gemv_config(4096, 4096, sm_count=132) == GemvConfig(block_n=16, block_k=1024, num_warps=8)
    assert gemv_config(4096, 4096, sm_count=114) == GemvConfig(block_n=16, block_k=512)  # another GPU: rule
    # the rule: the widest block_n up to 16 with 1.5 programs per SM, 8 KB weight tiles
    assert gemv_config(6144, 4096, sm_count=132) == gemv_config(6144, 4096, sm_count=131)
    assert gemv_config(6144, 4096, sm_count=131) == GemvConfig(block_n=16, block_k=512)
    assert gemv_config(3072, 2048, sm_count=131) == GemvConfig(block_n=8, block_k=1024)
    assert gemv_config(28672, 4096, sm_count=132) == GemvConfig(block_n=16, block_k=512)
    assert gemv_config(64, 64, sm_count=132) == GemvConfig(block_n=4, block_k=2048)
    assert GemvConfig(block_n=8, block_k=1024).tile_k(8) == 128 and GemvConfig(block_k=64).tile_k(8) == 16


def _bad_arguments():
    x, weight, weight_scale = _inputs(2, 32, 64, torch.float32)
    too_many_rows, two_scales = x.new_zeros(MAX_ROWS + 1, 64), torch.ones(2, device=DEVICE)
    return [
        (lambda: fp8_gemv(x.view(1, 2, 64), weight, weight_scale), "x: expected 2 dims"),
        (lambda: fp8_gemv(x.to(torch.int32), weight, weight_scale), "x: dtype torch.int32 is not one of"),
        (lambda: fp8_gemv(too_many_rows, weight, weight_scale), f"x: at most {MAX_ROWS} rows"),
        (lambda: fp8_gemv(x, weight.float(), weight_scale), "weight: dtype torch.float32 is not one of"),
        (lambda: fp8_gemv(x, weight[:, :32], weight_scale), r"weight: expected 64 columns \(x's\)"),
        (lambda: fp8_gemv(x, weight, weight_scale[:16]), r"weight_scale: expected shape \(32,\)"),
        (lambda: fp8_gemv(x, weight, weight_scale.double()), "weight_scale: dtype torch.float64"),
        (lambda: fp8_gemv(x, weight, weight_scale, two_scales), "input_scale: expected shape"),
        (lambda: fp8_gemv(x, weight, weight_scale, two_scales.double()[:1]), "input_scale: dtype"),
        (lambda: GemvConfig(block_n=24), "block_n: must be a power of two >= 1, got 24"),
        (lambda: GemvConfig(block_k=8), "block_k: must be a power of two >= 16, got 8"),
        (lambda: GemvConfig(num_warps=3), "num_warps: must be 1, 2, 4, 8 or 16, got 3"),
        (lambda: GemvConfig(split_k=3), "split_k: must be 1, 2, 4, 8 or 16, got 3"),
        (lambda: GemvConfig(split_k=0), "split_k: must be 1, 2, 4, 8 or 16, got 0"),
        (lambda: GemvConfig(amax_k=8), "amax_k: must be a power of two >= 16, got 8"),
        (lambda: GemvConfig(amax_k=3000), "amax_k: must be a power of two >= 16, got 3000"),
        (lambda: GemvConfig(stages=0), "stages: must be 1, 2, 3 or 4, got 0"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_arguments())))
def test_bad_arguments_raise_naming_the_argument(index):
    call, message = _bad_arguments()[index]
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    ("matmul", "dtype"),
    [("rowwise", torch.bfloat16), ("tensorwise", torch.float16), ("tensorwise", torch.float32)],
)
@pytest.mark.parametrize("activations", ["token", "static"])
def test_decode_sized_steps_of_scaled_mm_layers_run_the_gemv(matmul, dtype, activations):
    """Up to GEMV_MAX_ROWS rows: one `fp8_gemv` launch (no separate quantization), the emulated product but
    for the sums' order, then the bias."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    layer = fp8_layer(weight, matmul, dtype, activations, bias=bias, device=DEVICE)
    method = layer.method
    gemv_calls, quantize_calls = [], []
    gemv, quantize = method._fp8_gemv, method._quantize_fp8
    method._fp8_gemv = lambda x, *args, **kw: gemv_calls.append(x.shape) or gemv(x, *args, **kw)
    method._quantize_fp8 = lambda x, *args: quantize_calls.append(x.shape) or quantize(x, *args)
    x = (torch.randn(GEMV_MAX_ROWS, 64, generator=gen) * 2).to(dtype).to(DEVICE).view(GEMV_MAX_ROWS, 1, 64)
    y = layer(x)
    assert gemv_calls == [(GEMV_MAX_ROWS, 64)] and quantize_calls == []
    input_scale = getattr(layer, "input_scale", None)
    x_q, x_scale = quantize_activations(
        x.reshape(-1, 64).cpu(), activations, None if input_scale is None else input_scale.cpu()
    )
    expected = (x_q.float() @ layer.weight.cpu().float().t()) * x_scale * layer.weight_scale.cpu()
    # The product rounded to the model dtype, then the bias added: an ulp or two of the largest value (and
    # the sums' order in float32). On a GPU the layer's own `_scaled_mm` is no reference at float32: fp8
    # tensor cores accumulate in less than fp32 (1% off on an H100).
    atol = max(2 * torch.finfo(dtype).eps, 1e-5) * (
        expected.abs().max().item() + layer.bias.abs().max().item()
    )
    expected = (expected.to(DEVICE) + layer.bias.float()).view(x.shape[:-1] + (32,))
    torch.testing.assert_close(y.float(), expected, rtol=0, atol=atol)


def test_more_rows_or_a_larger_weight_quantize_first(monkeypatch):
    # the H200's choice (run 12): llama-3-8b's o and llama-3.2-1b's down on the gemv, 8b's qkv and down not
    assert runs_gemv(GEMV_MAX_ROWS, 4096, 4096) and runs_gemv(1, 2048, 8192)
    assert not runs_gemv(1, 6144, 4096) and not runs_gemv(1, 4096, 14336)
    assert not runs_gemv(GEMV_MAX_ROWS + 1, 32, 64)
    monkeypatch.setattr(fp8_linear, "GEMV_MAX_WEIGHT", 32 * 64)  # a weight of 48 x 64 is past it
    assert runs_gemv(1, 32, 64) and not runs_gemv(1, 48, 64)
    gen = torch.Generator().manual_seed(6)
    layer = fp8_layer(torch.randn(48, 64, generator=gen), "rowwise", torch.bfloat16, "token", device=DEVICE)
    method = layer.method
    gemv_calls, quantize_calls = [], []
    gemv, quantize = method._fp8_gemv, method._quantize_fp8
    method._fp8_gemv = lambda x, *args, **kw: gemv_calls.append(x.shape) or gemv(x, *args, **kw)
    method._quantize_fp8 = lambda x, *args: quantize_calls.append(x.shape) or quantize(x, *args)
    layer(torch.randn(1, 64, generator=gen).to(torch.bfloat16).to(DEVICE))
    assert gemv_calls == [] and quantize_calls == [(1, 64)]  # then `fp8_skinny_mm` (runs_skinny)
