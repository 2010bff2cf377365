"""`fp8_skinny_mm` against the emulated FP8 product (the e4m3 codes widened to float32, multiplied, scaled):
rows 1-64, split K or not, shapes off the tiles, per-token and static activation scales, bad arguments."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import fp8_layer
from paged_batch import DEVICE

from sluice.engine.worker.layers.fp8_linear import (
    GEMV_MAX_ROWS,
    GEMV_MAX_WEIGHT,
    SKINNY_MAX_ROWS,
    quantize_activations,
    quantize_weight,
    runs_skinny,
)
from sluice.kernels.fp8_quant import quantize_fp8
from sluice.kernels.fp8_skinny_mm import MAX_ROWS, SWEPT_CONFIGS, SWEPT_SM_COUNT, fp8_skinny_mm, skinny_config
from sluice.kernels.split_k import SPLIT_COUNTERS, SkinnyConfig, split_counters


def _inputs(rows: int, out_features: int, in_features: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, in_features, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    weight, weight_scale = quantize_weight(torch.randn(out_features, in_features, generator=gen) * 0.05)
    x_q, x_scale = quantize_fp8(x)
    return x_q, x_scale, weight.to(DEVICE), weight_scale.to(DEVICE)


def _expected(x_q, x_scale, weight, weight_scale, out_dtype=torch.bfloat16):
    y = (x_q.float() @ weight.float().t()) * x_scale.view(-1, 1).float() * weight_scale.float()
    return y.to(out_dtype)


# On a GPU the fp8 tensor cores add a K tile's products in less than fp32 (the kernel puts each tile's sum
# into its fp32 accumulator); under the interpreter the sums are fp32 throughout.
FP32_RTOL = 2e-3 if DEVICE.type == "cuda" else 1e-5


def _assert_close(got, want):
    # the same exact products, summed in another order in float32, then one rounding to bf16
    torch.testing.assert_close(
        got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.float().abs().max().item()
    )


@pytest.mark.parametrize("rows", [1, 3, 16, 33, 64])
@pytest.mark.parametrize("split_k", [1, 4])
def test_matches_the_emulated_product(rows, split_k):
    x_q, x_scale, weight, weight_scale = _inputs(rows, 96, 320)  # N, K off the 64 x 128 tile
    config = SkinnyConfig(block_n=64, block_k=128, split_k=split_k)
    got = fp8_skinny_mm(x_q, x_scale, weight, weight_scale, config=config)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    _assert_close(got, _expected(x_q, x_scale, weight, weight_scale))


def test_split_k_sums_every_column_once():
    """K of 320 in splits of 128 (3 splits, the last of 64 columns; a fourth would have none)."""
    x_q, x_scale, weight, weight_scale = _inputs(5, 64, 320, seed=3)
    want = _expected(x_q, x_scale, weight, weight_scale, torch.float32)
    for split_k in (1, 2, 4, 8):
        got = fp8_skinny_mm(x_q, x_scale, weight, weight_scale, torch.float32, SkinnyConfig(split_k=split_k))
        torch.testing.assert_close(got, want, rtol=FP32_RTOL, atol=FP32_RTOL * want.abs().max().item())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "split_k"), [(1, 4), (5, 2), (64, 4)])
def test_the_fused_reduce_is_bit_for_bit_the_reduce_launch_and_leaves_its_counters_zero(
    rows, split_k, out_dtype, monkeypatch
):
    """K of 320: split_k 4 runs 3 splits of 128 columns (the last of 64), 2 runs 256 and 64; N of 200 in
    four channel blocks of 64, the last partial. The same launch twice (a graph replay's counters). New
    float tensors (the workspace, y) start as NaN, so that a sum read before its split stored it shows."""
    empty = torch.empty
    monkeypatch.setattr(
        torch,
        "empty",
        lambda *a, **k: t.fill_(float("nan")) if (t := empty(*a, **k)).is_floating_point() else t,
    )
    x_q, x_scale, weight, weight_scale = _inputs(rows, 200, 320, seed=rows)
    config = SkinnyConfig(split_k=split_k)
    want = fp8_skinny_mm(x_q, x_scale, weight, weight_scale, out_dtype, config)
    fused = SkinnyConfig(split_k=split_k, fused_reduce=True)
    for _ in range(2):
        got = fp8_skinny_mm(x_q, x_scale, weight, weight_scale, out_dtype, fused)
        assert torch.equal(got, want)
        counters = split_counters(got.device, 4)
        assert counters.shape == (SPLIT_COUNTERS,) and not counters.any()
    per_tensor = x_scale[:1].clone()  # one static scale that every row reads
    assert torch.equal(
        fp8_skinny_mm(x_q, per_tensor, weight, weight_scale, out_dtype, fused),
        fp8_skinny_mm(x_q, per_tensor, weight, weight_scale, out_dtype, config),
    )


def test_a_static_scale_of_one_element():
    x_q, _, weight, weight_scale = _inputs(7, 64, 128, seed=4)
    x_scale = torch.tensor([0.37], device=DEVICE)
    got = fp8_skinny_mm(x_q, x_scale, weight, weight_scale, config=SkinnyConfig(split_k=2))
    _assert_close(got, _expected(x_q, x_scale.expand(7), weight, weight_scale))


def test_no_rows_launch_nothing():
    x_q, x_scale, weight, weight_scale = _inputs(0, 32, 64)
    assert fp8_skinny_mm(x_q, x_scale, weight, weight_scale).shape == (0, 32)


def test_the_default_config_splits_k_until_every_sm_has_work():
    assert skinny_config(4096, 4096, sm_count=132, num_rows=16) == SkinnyConfig(
        split_k=4
    )  # 64 tiles x 4 >= 198
    assert skinny_config(6144, 4096, sm_count=132, num_rows=16) == SkinnyConfig(split_k=4)  # 96 x 2 < 198
    assert skinny_config(28672, 4096, sm_count=114, num_rows=16) == SkinnyConfig(split_k=1)  # 448 tiles
    assert skinny_config(4096, 256, sm_count=132, num_rows=64) == SkinnyConfig(
        split_k=2
    )  # splits >= 128 wide


def test_a_swept_shape_takes_the_sweeps_config_for_its_rows_on_the_swept_sm_count():
    shape = (28672, 4096)  # llama-3-8b gate_up
    (few, narrow), (most, wide) = SWEPT_CONFIGS[shape]
    assert (few, most) == (16, MAX_ROWS) and narrow.block_n == 32 and wide.block_n == 128
    assert [skinny_config(*shape, SWEPT_SM_COUNT, rows) for rows in (2, 16, 17, 64)] == [narrow] * 2 + [
        wide
    ] * 2
    assert skinny_config(*shape, SWEPT_SM_COUNT + 1, 64) == SkinnyConfig()  # another GPU: the rule


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda a: {**a, "x_q": torch.zeros(MAX_ROWS + 1, 64, dtype=torch.float8_e4m3fn)},
            "x_q: at most 64 rows",
        ),
        (lambda a: {**a, "x_q": a["x_q"].float()}, "x_q: dtype"),
        (lambda a: {**a, "weight": a["weight"][:, :32]}, "weight: "),
        (lambda a: {**a, "weight_scale": a["weight_scale"][:8]}, "weight_scale: expected shape"),
        (lambda a: {**a, "x_scale": torch.ones(3, 1)}, "x_scale: must hold 1 or 2"),
        (lambda a: {**a, "config": SkinnyConfig(block_k=16)}, "config: block_k must be at least 32"),
    ],
)
def test_bad_arguments_name_the_argument(change, message):
    x_q, x_scale, weight, weight_scale = _inputs(2, 32, 64)
    args = {
        "x_q": x_q.cpu(),
        "x_scale": x_scale.cpu(),
        "weight": weight.cpu(),
        "weight_scale": weight_scale.cpu(),
    }
    with pytest.raises(ValueError, match=message):
        fp8_skinny_mm(**change(args))


@pytest.mark.parametrize(
    ("matmul", "dtype"),
    [("rowwise", torch.bfloat16), ("tensorwise", torch.float16), ("tensorwise", torch.float32)],
)
@pytest.mark.parametrize("activations", ["token", "static"])
def test_layers_run_it_up_to_skinny_max_rows_where_the_gemv_does_not(matmul, dtype, activations):
    """Rows past GEMV_MAX_ROWS up to SKINNY_MAX_ROWS: `fp8_quant`'s codes, then `fp8_skinny_mm`; the
    emulated product of the same codes but for the sums' order, in the model's dtype, then the bias."""
    assert not runs_skinny(GEMV_MAX_ROWS, 32, 64) and runs_skinny(GEMV_MAX_ROWS + 1, 32, 64)
    assert runs_skinny(GEMV_MAX_ROWS, GEMV_MAX_WEIGHT // 64 + 1, 64)  # where the gemv does not run
    assert runs_skinny(SKINNY_MAX_ROWS, 1 << 20, 64) and not runs_skinny(SKINNY_MAX_ROWS + 1, 32, 64)
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    layer = fp8_layer(weight, matmul, dtype, activations, bias=bias, device=DEVICE)
    method = layer.method
    calls = []
    skinny = method._fp8_skinny_mm
    method._fp8_skinny_mm = lambda x_q, *args: calls.append(x_q.shape) or skinny(x_q, *args)
    rows = SKINNY_MAX_ROWS - 1
    x = (torch.randn(rows, 64, generator=gen) * 2).to(dtype).to(DEVICE)
    y = layer(x)
    assert calls == [(rows, 64)] and y.dtype == dtype
    input_scale = getattr(layer, "input_scale", None)
    x_q, x_scale = quantize_activations(
        x.cpu(), activations, None if input_scale is None else input_scale.cpu()
    )
    expected = (x_q.float() @ layer.weight.cpu().float().t()) * x_scale * layer.weight_scale.cpu()
    # float32 outputs: within the MMA's own rounding on a GPU (FP32_RTOL of the largest output, as above)
    atol = max(2 * torch.finfo(dtype).eps, FP32_RTOL) * (
        expected.abs().max().item() + layer.bias.abs().max().item()
    )
    torch.testing.assert_close(y.float(), expected.to(DEVICE) + layer.bias.float(), rtol=0, atol=atol)
