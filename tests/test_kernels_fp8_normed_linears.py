"""The one-row FP8 linears that make their RMSNorm (and the activation codes) in their own loads, against
the two launches each replaces: `fp8_normed_skinny_mm` against `rms_norm_fp8_quant` then `fp8_skinny_mm`,
`fp8_normed_gemv` against `rms_norm` then `fp8_gemv` (which quantizes its input itself): per-token, capped
and static scales, with and without the residual add, K split or not (and the gemv's prefetched and
pipelined tiles), bf16 / fp16 / fp32 rows; bad arguments."""

from __future__ import annotations

import pytest
import torch
from paged_batch import DEVICE

from sluice.engine.worker.layers.fp8_linear import quantize_weight
from sluice.kernels.fp8_gemv import GemvConfig, fp8_gemv, fp8_normed_gemv
from sluice.kernels.fp8_skinny_mm import fp8_normed_skinny_mm, fp8_skinny_mm
from sluice.kernels.rms_norm import NORM_MAX_ROWS, RowNorm, rms_norm, rms_norm_fp8_quant
from sluice.kernels.split_k import SkinnyConfig

EPS = 1e-5


def _inputs(out_features: int, in_features: int, dtype: torch.dtype, with_residual: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, in_features, generator=gen) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(1, in_features, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(in_features, generator=gen)).to(dtype).to(DEVICE)
    weight, weight_scale = quantize_weight(torch.randn(out_features, in_features, generator=gen) * 0.05)
    return x, residual, norm_weight, weight.to(DEVICE), weight_scale.to(DEVICE)


QUANTIZATIONS = {  # (input_scale, scale_ub)
    "token": lambda: (None, None),
    "capped": lambda: (None, 1.0),  # below the normed row's amax: its largest values saturate
    "static": lambda: (torch.tensor([0.02], device=DEVICE), None),
}


def _assert_as_unfused(got, want, dtype, residual_out, want_residual) -> None:
    """Bit for bit the two launches under the interpreter; on a GPU within a code step of a few values (the
    row's sum of squares reduced over another layout); the residual written bit for bit either way."""
    assert got.shape == (1, 96) and got.dtype == dtype and got.isfinite().all()
    if DEVICE.type == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=0.07, atol=0.07 * want.abs().max().item())
    if residual_out is not None:
        assert torch.equal(residual_out, want_residual)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("config", [SkinnyConfig(split_k=1), SkinnyConfig(split_k=2, fused_reduce=True)])
def test_the_row_is_rms_norm_fp8_quant_then_the_product(dtype, quantization, with_residual, config):
    """K of 320 ends inside a 128-column tile; the second config splits it (the reduce launch adds the
    splits: a fused reduce would read the scale before its writer stores it). Under the interpreter bit for
    bit the two launches; on a GPU the row's sum of squares is reduced over this launch's warps, so the
    codes may differ by one step where a value sits on a rounding boundary."""
    x, residual, norm_weight, weight, weight_scale = _inputs(96, 320, dtype, with_residual, seed=3)
    input_scale, scale_ub = QUANTIZATIONS[quantization]()
    residual_out = torch.full_like(x, float("nan")) if with_residual else None
    norm = RowNorm(norm_weight, EPS, residual, residual_out)
    got = fp8_normed_skinny_mm(x, norm, weight, weight_scale, input_scale, scale_ub, config)
    x_q, x_scale, want_residual = rms_norm_fp8_quant(
        x, norm_weight, EPS, residual, input_scale, scale_ub=scale_ub
    )
    want = fp8_skinny_mm(x_q, x_scale, weight, weight_scale, dtype, config)
    _assert_as_unfused(got, want, dtype, residual_out, want_residual)


GEMV_CONFIGS = [  # 128-column tiles: K of 320 in three, the last partial
    GemvConfig(block_n=8, block_k=128),
    GemvConfig(block_n=8, block_k=128, split_k=2),
    GemvConfig(block_n=8, block_k=128, prefetch=True),
    GemvConfig(block_n=8, block_k=128, stages=2),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("config", GEMV_CONFIGS)
def test_the_gemvs_row_is_rms_norm_then_the_gemv(dtype, quantization, with_residual, config):
    """The gemv's smaller weights (the 1b's qkv_proj): its amax pass replaced by the norm's, each tile
    normalized as it is loaded and quantized by the gemv's own helper. Bit for bit under the interpreter;
    on a GPU the row's sum of squares is reduced over another layout, as above."""
    x, residual, norm_weight, weight, weight_scale = _inputs(96, 320, dtype, with_residual, seed=5)
    input_scale, scale_ub = QUANTIZATIONS[quantization]()
    residual_out = torch.full_like(x, float("nan")) if with_residual else None
    norm = RowNorm(norm_weight, EPS, residual, residual_out)
    got = fp8_normed_gemv(x, norm, weight, weight_scale, input_scale, scale_ub, config)
    normed, want_residual = rms_norm(x, norm_weight, EPS, residual)
    want = fp8_gemv(normed, weight, weight_scale, input_scale, config, scale_ub)
    _assert_as_unfused(got, want, dtype, residual_out, want_residual)


def test_no_rows_give_an_empty_output():
    x, _, norm_weight, weight, weight_scale = _inputs(32, 64, torch.bfloat16, False)
    for launch in (fp8_normed_skinny_mm, fp8_normed_gemv):
        got = launch(x[:0], RowNorm(norm_weight, EPS, None, None), weight, weight_scale)
        assert got.shape == (0, 32)


def test_bad_arguments_name_the_argument():
    x, residual, norm_weight, weight, weight_scale = _inputs(32, 64, torch.bfloat16, True)
    norm = RowNorm(norm_weight, EPS, None, None)
    with pytest.raises(ValueError, match=f"^x: at most {NORM_MAX_ROWS} row with a norm, got 2$"):
        fp8_normed_skinny_mm(x.expand(2, 64).contiguous(), norm, weight, weight_scale)
    with pytest.raises(ValueError, match="^x: dtype torch.float8_e4m3fn is not one of"):
        fp8_normed_skinny_mm(x.to(torch.float8_e4m3fn), norm, weight, weight_scale)
    with pytest.raises(ValueError, match="^norm: residual and residual_out go together$"):
        fp8_normed_skinny_mm(x, norm._replace(residual=residual), weight, weight_scale)
    with pytest.raises(ValueError, match="^weight: dtype torch.bfloat16 is not one of"):
        fp8_normed_skinny_mm(x, norm, weight.to(torch.bfloat16), weight_scale)
    with pytest.raises(ValueError, match=r"^weight: expected shape \(32, 64\), got \(32, 48\)$"):
        fp8_normed_skinny_mm(x, norm, weight[:, :48].contiguous(), weight_scale)
    with pytest.raises(ValueError, match=r"^weight_scale: expected shape \(32,\), got \(31,\)$"):
        fp8_normed_skinny_mm(x, norm, weight, weight_scale[:31])
    with pytest.raises(ValueError, match="^scale_ub: caps per-token scales, not with an input_scale"):
        fp8_normed_skinny_mm(x, norm, weight, weight_scale, torch.ones(1, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match=r"^input_scale: expected shape \(\) or \(1,\), got \(2,\)$"):
        fp8_normed_skinny_mm(x, norm, weight, weight_scale, torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="^config: block_k must be at least 32"):
        fp8_normed_skinny_mm(x, norm, weight, weight_scale, config=SkinnyConfig(block_k=16))
    with pytest.raises(ValueError, match=f"^x: at most {NORM_MAX_ROWS} row with a norm, got 2$"):
        fp8_normed_gemv(x.expand(2, 64).contiguous(), norm, weight, weight_scale)
    with pytest.raises(
        ValueError, match="^norm.residual_out: must not share memory with x or norm.residual$"
    ):
        fp8_normed_gemv(x, norm._replace(residual=residual, residual_out=residual), weight, weight_scale)
    with pytest.raises(ValueError, match="^scale_ub: caps per-token scales, not with an input_scale"):
        fp8_normed_gemv(x, norm, weight, weight_scale, torch.ones(1, device=DEVICE), 1.0)
