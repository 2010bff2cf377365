"""`skinny_mm` (the float linear on the swapped, split-K launch) against the product in float64: rows 1-64,
K split or not, shapes off the tiles, fp32, fp16 and bf16 (bf16 widened to fp32 under the interpreter, whose
bf16 dot is wrong), its default config, bad arguments; and `SkinnyLinearMethod` on a layer (bias, more
rows)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from paged_batch import DEVICE, KERNEL_DTYPES

from sluice.engine.worker.layers.linear_method import GatedRows, NormedRows, SkinnyLinearMethod
from sluice.kernels.fp8_skinny_mm import MAX_ROWS
from sluice.kernels.rms_norm import NORM_MAX_ROWS, RowNorm, rms_norm
from sluice.kernels.silu_and_mul import silu_and_mul
from sluice.kernels.skinny_mm import FLOAT_BLOCK_K, float_skinny_config, skinny_mm
from sluice.kernels.split_k import SkinnyConfig


def _inputs(rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype).to(DEVICE)
    return x, weight


def _assert_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    want = x.double() @ weight.double().t()  # the exact products; the kernel sums them in fp32
    # fp32: IEEE products, on the GPU too; 16-bit outputs: one rounding at the end (bf16: 2^-8 relative)
    rtol = 1e-5 if got.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 33, 64])
@pytest.mark.parametrize("split_k", [1, 4])
def test_matches_the_product(rows, split_k, dtype):
    x, weight = _inputs(rows, 96, 320, dtype)  # N, K off the 64 x 64 tile
    got = skinny_mm(x, weight, SkinnyConfig(block_n=64, block_k=FLOAT_BLOCK_K, split_k=split_k))
    assert got.shape == (rows, 96) and got.dtype == dtype
    _assert_close(got, x, weight)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("split_k", [1, 4])
def test_gated_rows_are_bit_for_bit_silu_and_mul_then_the_product(rows, split_k, dtype):
    """[gate | up] activated as each tile is loaded: the same bits as silu_and_mul's launch, then skinny_mm
    (the padding rows of 5 read row 4; K of 320 ends inside the last split's tile)."""
    gate_up, weight = _inputs(rows, 96, 640, dtype, seed=11)
    weight = weight[:, :320].contiguous()
    config = SkinnyConfig(block_k=FLOAT_BLOCK_K, split_k=split_k)
    got = skinny_mm(gate_up, weight, config, gated=True)
    assert torch.equal(got, skinny_mm(silu_and_mul(gate_up), weight, config))
    _assert_close(got, silu_and_mul(gate_up), weight)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("with_residual", [False, True])
def test_a_normed_row_is_rms_norm_then_the_product(split_k, dtype, with_residual):
    """One row normalized (after the residual add) as each tile is loaded: `rms_norm`'s roundings. Under the
    interpreter bit for bit rms_norm's launch then skinny_mm; on a GPU the row's sum of squares is reduced
    over another layout (this launch's warps), so within the 16-bit rounding. x + residual is written once,
    bit for bit rms_norm's residual_out."""
    x, weight = _inputs(1, 96, 320, dtype, seed=13)
    gen = torch.Generator().manual_seed(14)
    residual = torch.randn(1, 320, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(320, generator=gen)).to(dtype).to(DEVICE)
    residual_out = torch.full_like(x, float("nan")) if with_residual else None
    config = SkinnyConfig(block_k=FLOAT_BLOCK_K, split_k=split_k)
    got = skinny_mm(x, weight, config, norm=RowNorm(norm_weight, 1e-5, residual, residual_out))
    normed, want_residual = rms_norm(x, norm_weight, 1e-5, residual)
    want = skinny_mm(normed, weight, config)
    if DEVICE.type == "cpu":
        assert torch.equal(got, want)
    else:
        _assert_close(got, normed, weight)
    if with_residual:
        assert torch.equal(residual_out, want_residual)


def test_a_normed_launch_keeps_no_tensor_of_its_step():
    """Nothing of a step outlives it: a served model makes a residual_out every layer of every step."""
    x, weight = _inputs(1, 32, 64, torch.float32, seed=16)
    residual, residual_out = torch.randn_like(x), torch.empty_like(x)
    collected = weakref.ref(residual_out)
    skinny_mm(x, weight, norm=RowNorm(torch.ones(64, device=DEVICE), 1e-5, residual, residual_out))
    del residual_out
    gc.collect()
    assert collected() is None


def test_split_k_sums_every_column_once():
    """K of 320 in splits of 64 columns and more (up to 5 splits; an eighth would have none)."""
    x, weight = _inputs(5, 64, 320, torch.float32, seed=3)
    for split_k in (1, 2, 4, 8):
        _assert_close(skinny_mm(x, weight, SkinnyConfig(block_k=FLOAT_BLOCK_K, split_k=split_k)), x, weight)


def test_the_default_config_splits_k_until_every_sm_has_work():
    """llama-3.2-1b's linears on 132 SMs: 1.5 programs an SM, K slices of at least 64 columns."""
    assert float_skinny_config(3072, 2048, 132) == SkinnyConfig(block_k=64, split_k=8)  # 48 channel blocks
    assert float_skinny_config(2048, 8192, 132) == SkinnyConfig(block_k=64, split_k=8)  # down: 32
    assert float_skinny_config(16384, 2048, 132) == SkinnyConfig(block_k=64, split_k=1)  # gate_up: 256
    assert float_skinny_config(64, 128, 132).split_k == 2  # K stops it: two slices of 64
    x, weight = _inputs(2, 64, 512, torch.float32, seed=5)
    _assert_close(skinny_mm(x, weight), x, weight)  # this device's config


def test_no_rows_and_no_channels_give_empty_outputs():
    x, weight = _inputs(0, 32, 64, torch.float32)
    assert skinny_mm(x, weight).shape == (0, 32)
    x, weight = _inputs(2, 0, 64, torch.float32)
    assert skinny_mm(x, weight).shape == (2, 0)


def test_bad_arguments_name_the_argument():
    x, weight = _inputs(2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match=f"^x: at most {MAX_ROWS} rows, got {MAX_ROWS + 1}$"):
        skinny_mm(torch.zeros(MAX_ROWS + 1, 64, device=DEVICE), weight)
    with pytest.raises(ValueError, match="^weight: dtype torch.float16 is not one of"):
        skinny_mm(x, weight.half())
    with pytest.raises(ValueError, match=r"^weight: expected shape \(32, 64\), got \(32, 48\)$"):
        skinny_mm(x, weight[:, :48].contiguous())
    with pytest.raises(ValueError, match="^x: dtype torch.int32 is not one of"):
        skinny_mm(x.int(), weight)
    with pytest.raises(ValueError, match="^weight: last dim must be contiguous"):
        skinny_mm(x, weight.t().contiguous().t())
    with pytest.raises(ValueError, match=r"^x: gated rows are \[gate \| up\], an even width, got 63$"):
        skinny_mm(x[:, :63].contiguous(), weight, gated=True)
    with pytest.raises(ValueError, match=r"^weight: expected shape \(32, 32\), got \(32, 64\)$"):
        skinny_mm(x, weight, gated=True)  # 64 columns of [gate | up]: a 32-wide input
    norm = RowNorm(torch.ones(64, device=DEVICE), 1e-5, None, None)
    with pytest.raises(ValueError, match=f"^x: at most {NORM_MAX_ROWS} row with a norm, got 2$"):
        skinny_mm(x, weight, norm=norm)
    row = x[:1]
    with pytest.raises(ValueError, match=r"^norm.weight: expected shape \(64,\), got \(32,\)$"):
        skinny_mm(row, weight, norm=norm._replace(weight=torch.ones(32, device=DEVICE)))
    with pytest.raises(ValueError, match="^norm: residual and residual_out go together$"):
        skinny_mm(row, weight, norm=norm._replace(residual=row.clone()))
    with pytest.raises(
        ValueError, match="^norm.residual_out: must not share memory with x or norm.residual$"
    ):
        skinny_mm(row, weight, norm=norm._replace(residual=row.clone(), residual_out=row))
    with pytest.raises(ValueError, match=r"^norm: a normed input is not a gated one \(gated=True\)$"):
        skinny_mm(torch.zeros(1, 128, device=DEVICE), weight, gated=True, norm=norm)


class _Layer(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


@pytest.mark.parametrize("rows", [1, MAX_ROWS, MAX_ROWS + 1])  # the last one on F.linear
def test_the_linear_method_adds_the_bias_and_keeps_the_leading_dims(rows):
    x, weight = _inputs(rows, 48, 128, torch.float32, seed=7)
    bias = torch.randn(48).to(DEVICE)
    got = SkinnyLinearMethod().apply(_Layer(weight), x.view(rows, 1, 128), bias)
    assert got.shape == (rows, 1, 48)
    want = F.linear(x.double(), weight.double(), bias.double()).view(rows, 1, 48)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_linear_method_takes_one_normed_row():
    x, weight = _inputs(1, 48, 128, torch.float32, seed=15)
    layer, method = _Layer(weight), SkinnyLinearMethod()
    assert method.normed_input(layer, NORM_MAX_ROWS) and not method.normed_input(layer, NORM_MAX_ROWS + 1)
    residual, residual_out, norm_weight = torch.randn_like(x), torch.empty_like(x), torch.rand(128).to(DEVICE)
    got = method.apply(layer, NormedRows(x, norm_weight, 1e-6, residual, residual_out), None)
    normed, want_residual = rms_norm(x, norm_weight, 1e-6, residual)
    torch.testing.assert_close(got, F.linear(normed, weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(residual_out, want_residual)


def test_the_linear_method_takes_gated_rows_up_to_the_kernels_rows():
    gate_up, weight = _inputs(MAX_ROWS + 1, 48, 256, torch.float32, seed=9)
    layer, method = _Layer(weight[:, :128].contiguous()), SkinnyLinearMethod()
    assert method.gated_input(layer, MAX_ROWS) and not method.gated_input(layer, MAX_ROWS + 1)
    got = method.apply(layer, GatedRows(gate_up[:3]), None)
    assert torch.equal(got, skinny_mm(silu_and_mul(gate_up[:3]), layer.weight))
    with pytest.raises(ValueError, match=f"^x: at most {MAX_ROWS} gated rows, got {MAX_ROWS + 1}$"):
        method.apply(layer, GatedRows(gate_up), None)
