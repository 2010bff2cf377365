"""The FP8 linears that make SiLU-and-mul (and the activation codes) in their own loads, against the two
launches each replaces: `fp8_gated_skinny_mm` against `silu_and_mul_fp8_quant` then `fp8_skinny_mm`,
`fp8_gated_gemv` against `silu_and_mul` then `fp8_gemv` (which quantizes its input itself): per-token,
capped and static scales, K split or not (and the gemv's prefetched and pipelined tiles, and its several
rows), the skinny launch's amax pass over one tile or several, bf16 / fp16 / fp32 rows; bad arguments.
Bit for bit everywhere: the same jit helpers make the same values, and a row's amax is the same maximum
whichever order its tiles are read in."""

from __future__ import annotations

import pytest
import torch
from paged_batch import DEVICE
from test_kernels_fp8_normed_linears import QUANTIZATIONS  # the capped one saturates these rows too

from sluice.engine.worker.layers.fp8_linear import quantize_weight
from sluice.kernels import fp8_skinny_mm as skinny
from sluice.kernels.fp8_gemv import MAX_ROWS as GEMV_MAX_ROWS
from sluice.kernels.fp8_gemv import GemvConfig, fp8_gated_gemv, fp8_gemv
from sluice.kernels.fp8_skinny_mm import GATED_MAX_ROWS, fp8_gated_skinny_mm, fp8_skinny_mm
from sluice.kernels.silu_and_mul import silu_and_mul, silu_and_mul_fp8_quant
from sluice.kernels.split_k import SkinnyConfig


def _inputs(num_rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0):
    """gate_up [num_rows, 2 * in_features] and an e4m3 weight [out_features, in_features] with its scales."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_rows, 2 * in_features, generator=gen) * 3).to(dtype).to(DEVICE)
    weight, weight_scale = quantize_weight(torch.randn(out_features, in_features, generator=gen) * 0.05)
    return gate_up, weight.to(DEVICE), weight_scale.to(DEVICE)


def _assert_equal(got: torch.Tensor, want: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> None:
    assert got.shape == shape and got.dtype == dtype and got.isfinite().all()
    assert want.abs().max() > 0  # a product that could have been wrong
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
@pytest.mark.parametrize("config", [SkinnyConfig(split_k=1), SkinnyConfig(split_k=2, fused_reduce=True)])
@pytest.mark.parametrize("amax_tile", [128, skinny.GATED_AMAX_TILE])
def test_the_row_is_silu_and_mul_fp8_quant_then_the_product(
    dtype, quantization, config, amax_tile, monkeypatch
):
    """K of 320 ends inside a 128-column tile; the second config splits it (the reduce launch adds the
    splits, with the scale program (0, 0) wrote). An amax tile of 128 walks the row in three tiles, the
    last partial; the default holds it in one."""
    monkeypatch.setattr(skinny, "GATED_AMAX_TILE", amax_tile)
    gate_up, weight, weight_scale = _inputs(1, 96, 320, dtype, seed=3)
    input_scale, scale_ub = QUANTIZATIONS[quantization]()
    got = fp8_gated_skinny_mm(gate_up, weight, weight_scale, input_scale, scale_ub, config)
    x_q, x_scale = silu_and_mul_fp8_quant(gate_up, input_scale, scale_ub=scale_ub)
    want = fp8_skinny_mm(x_q, x_scale, weight, weight_scale, dtype, config)
    _assert_equal(got, want, (1, 96), dtype)


GEMV_CONFIGS = [  # 128-column tiles at one row: K of 320 in three, the last partial
    GemvConfig(block_n=8, block_k=128),
    GemvConfig(block_n=8, block_k=128, split_k=2),
    GemvConfig(block_n=8, block_k=128, prefetch=True),
    GemvConfig(block_n=8, block_k=128, stages=2, amax_k=256),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
@pytest.mark.parametrize("config", GEMV_CONFIGS)
@pytest.mark.parametrize("num_rows", [1, 3])
def test_the_gemvs_rows_are_silu_and_mul_then_the_gemv(dtype, quantization, config, num_rows):
    """The gemv's smaller weights (the 1b's down_proj): its amax pass and its product activate each tile
    of [gate | up] as they load it. Three rows pad to four: the padding row repeats the last (its output
    is never stored)."""
    gate_up, weight, weight_scale = _inputs(num_rows, 96, 320, dtype, seed=5)
    input_scale, scale_ub = QUANTIZATIONS[quantization]()
    got = fp8_gated_gemv(gate_up, weight, weight_scale, input_scale, scale_ub, config)
    want = fp8_gemv(silu_and_mul(gate_up), weight, weight_scale, input_scale, config, scale_ub)
    _assert_equal(got, want, (num_rows, 96), dtype)


def test_a_nan_in_the_row_makes_its_outputs_nan_as_unfused():
    """A NaN in gate makes the row's amax NaN, so every code and output is NaN, as the two launches make
    them (`amax_keep_nan`)."""
    gate_up, weight, weight_scale = _inputs(1, 32, 64, torch.bfloat16)
    gate_up[0, 5] = float("nan")
    got = fp8_gated_skinny_mm(gate_up, weight, weight_scale)
    assert got.isnan().all()
    assert fp8_gated_gemv(gate_up, weight, weight_scale).isnan().all()


def test_no_rows_give_an_empty_output():
    gate_up, weight, weight_scale = _inputs(0, 32, 64, torch.bfloat16)
    for launch in (fp8_gated_skinny_mm, fp8_gated_gemv):
        assert launch(gate_up, weight, weight_scale).shape == (0, 32)


def test_bad_arguments_name_the_argument():
    gate_up, weight, weight_scale = _inputs(2, 32, 64, torch.bfloat16)
    row = gate_up[:1]
    with pytest.raises(ValueError, match=f"^gate_up: at most {GATED_MAX_ROWS} row, got 2$"):
        fp8_gated_skinny_mm(gate_up, weight, weight_scale)
    with pytest.raises(ValueError, match="^gate_up: dtype torch.float8_e4m3fn is not one of"):
        fp8_gated_skinny_mm(row.to(torch.float8_e4m3fn), weight, weight_scale)
    with pytest.raises(ValueError, match=r"^gate_up: last dim must be even \(\[gate \| up\]\), got 127$"):
        fp8_gated_skinny_mm(row[:, :127].contiguous(), weight, weight_scale)
    with pytest.raises(ValueError, match=r"^weight: expected shape \(32, 64\), got \(32, 48\)$"):
        fp8_gated_skinny_mm(row, weight[:, :48].contiguous(), weight_scale)
    with pytest.raises(ValueError, match=r"^weight_scale: expected shape \(32,\), got \(31,\)$"):
        fp8_gated_skinny_mm(row, weight, weight_scale[:31])
    with pytest.raises(ValueError, match="^scale_ub: caps per-token scales, not with an input_scale"):
        fp8_gated_skinny_mm(row, weight, weight_scale, torch.ones(1, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="^config: block_k must be at least 32"):
        fp8_gated_skinny_mm(row, weight, weight_scale, config=SkinnyConfig(block_k=16))
    rows = row.expand(GEMV_MAX_ROWS + 1, 128)
    with pytest.raises(ValueError, match=f"^gate_up: at most {GEMV_MAX_ROWS} rows, got shape"):
        fp8_gated_gemv(rows.contiguous(), weight, weight_scale)
    with pytest.raises(ValueError, match=r"^gate_up: last dim must be even \(\[gate \| up\]\), got 127$"):
        fp8_gated_gemv(row[:, :127].contiguous(), weight, weight_scale)
    with pytest.raises(
        ValueError, match=r"^weight: expected 64 columns \(half gate_up's\), got shape \(32, 128\)$"
    ):
        fp8_gated_gemv(row, torch.cat([weight, weight], dim=1), weight_scale)
    with pytest.raises(ValueError, match=r"^input_scale: expected shape \(\) or \(1,\), got \(2,\)$"):
        fp8_gated_gemv(row, weight, weight_scale, torch.ones(2, device=DEVICE))
