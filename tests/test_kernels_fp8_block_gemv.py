"""`sluice.kernels.fp8_block_gemv`, the block-wise FP8 linear's one-launch path for a few rows: y equals
`fp8_block_mm_reference` on `quantize_activation_groups`' codes and scales (the CPU path's quantizer) but for
the order of the fp32 sums; a weight that picks one column of x per output makes y x's dequantized codes
exactly, so the fused quantization is checked bit for bit. Outputs are poisoned first. Under
TRITON_INTERPRET=1 on CPU; on a GPU, on CUDA."""

from __future__ import annotations

import pytest
import torch
from paged_batch import DEVICE
from test_kernels_fp8_block_mm import BLOCK_SHAPES, _assert_matches_reference, _mm_inputs, _random_rows

from sluice.engine.worker.layers.fp8_blocks import per_element_scales, quantize_activation_groups
from sluice.kernels.fp8_block_gemv import MAX_ROWS, BlockGemvConfig, block_gemv_config, fp8_block_gemv
from sluice.kernels.fp8_block_mm import FP8

# tiles that take one group a step, several, and more than the row has (the step's groups past K masked)
CONFIGS = [None, BlockGemvConfig(block_n=4, groups=1), BlockGemvConfig(block_n=16, groups=8, num_warps=2)]


def _inputs(num_rows, out_features, in_features, block, dtype, seed):
    """x (normals times 1e-3..1e3 per column: each group its own scale) and `_mm_inputs`' weight."""
    _, _, w_q, w_scale = _mm_inputs(num_rows, out_features, in_features, block, seed=seed)
    return _random_rows(num_rows, in_features, dtype, seed=seed), w_q, w_scale


def _gemv(x, w_q, w_scale, block, config=None):
    """The kernel's y (on CPU), written into a NaN-poisoned output."""
    out = torch.full((x.shape[0], w_q.shape[0]), float("nan"), dtype=x.dtype, device=DEVICE)
    y = fp8_block_gemv(x, w_q, w_scale, block, config, out=out)
    assert y is out
    return y.cpu()


def _assert_is_the_reference(got, x, w_q, w_scale, block):
    x_q, x_scale = quantize_activation_groups(x.cpu(), block[1])
    _assert_matches_reference(got, (x_q, x_scale, w_q.cpu(), w_scale.cpu()), block, x.dtype)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "rule" if c is None else f"{c.block_n}x{c.groups}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize(("block", "shape"), [*BLOCK_SHAPES, ((128, 128), (200, 300))])
def test_block_gemv_matches_the_reference(block, shape, num_rows, dtype, config):
    inputs = _inputs(num_rows, *shape, block, dtype, seed=num_rows)
    _assert_is_the_reference(_gemv(*inputs, block, config), *inputs, block)


def test_fp16_activations():
    x, w_q, w_scale = _inputs(2, 40, 72, (16, 16), torch.float16, seed=7)
    w_scale = w_scale * 1e-4  # y within fp16's range
    _assert_is_the_reference(_gemv(x, w_q, w_scale, (16, 16)), x, w_q, w_scale, (16, 16))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "rule" if c is None else f"{c.block_n}x{c.groups}")
@pytest.mark.parametrize(("num_rows", "block", "in_features"), [(1, (16, 32), 100), (5, (32, 16), 72)])
def test_a_weight_that_picks_one_column_gives_the_dequantized_codes_exactly(
    num_rows, block, in_features, config
):
    """Output n reads column n of x (code 1.0, scale 1): y[m, n] = x_q[m, n] * x_scale[m, n // block_k], one
    exact product, so the kernel's codes and scales are quantize_activation_groups' bit for bit."""
    x = _random_rows(num_rows, in_features, torch.float32, seed=in_features).cpu()
    x[:, 3 * block[1] : 4 * block[1]] = 0.0  # a group of zeros (scale float32's tiny, codes 0)
    w_q = torch.eye(in_features).to(FP8).to(DEVICE)
    w_scale = torch.ones(-(-in_features // block[0]), -(-in_features // block[1]), device=DEVICE)
    x_q, x_scale = quantize_activation_groups(x, block[1])
    want = x_q.float() * per_element_scales(x_scale, (1, block[1]), x.shape)
    got = _gemv(x.to(DEVICE), w_q, w_scale, block, config)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_a_nan_in_x_spreads_to_its_rows_outputs_only():
    x, w_q, w_scale = _inputs(3, 40, 72, (16, 16), torch.float32, seed=2)
    x[1, 30] = float("nan")
    got = _gemv(x, w_q, w_scale, (16, 16))
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()


def test_row_strided_input_and_output():
    block = (16, 32)
    x, w_q, w_scale = _inputs(3, 48, 80, block, torch.bfloat16, seed=3)
    wide = torch.zeros(3, 96, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 8:88] = x
    buffer = torch.full((3, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    y = fp8_block_gemv(wide[:, 8:88], w_q, w_scale, block, out=buffer[:, :48])
    assert y.stride(0) == 64 and buffer[:, 48:].isnan().all()
    _assert_is_the_reference(y.cpu(), x, w_q, w_scale, block)


def test_no_rows_or_outputs_launch_nothing():
    x, w_q, w_scale = _inputs(0, 32, 64, (16, 16), torch.float32, seed=0)
    assert fp8_block_gemv(x, w_q, w_scale, (16, 16)).shape == (0, 32)
    x, w_q, w_scale = _inputs(2, 0, 64, (16, 16), torch.float32, seed=0)
    assert fp8_block_gemv(x, w_q, w_scale, (16, 16)).shape == (2, 0)


def test_the_rule_gives_every_sm_programs_and_steps_of_8_kb():
    assert block_gemv_config(6144, 4096, 128, 132) == BlockGemvConfig(16, 4)  # llama-3-8b qkv
    assert block_gemv_config(2048, 8192, 128, 132) == BlockGemvConfig(8, 8)  # llama-3.2-1b down
    assert block_gemv_config(256, 1024, 128, 132) == BlockGemvConfig(4, 8)  # no more groups than the row's 8
    assert block_gemv_config(64, 40, 16, 4) == BlockGemvConfig(8, 4)  # 8 programs for 4 SMs; 3 groups: 4
    assert BlockGemvConfig(16, 4).step_groups(8) == 1 and BlockGemvConfig(16, 8).step_groups(2) == 4


def _bad_arguments():
    x, w_q, w_scale = _inputs(4, 48, 64, (32, 16), torch.float32, seed=1)  # 4 K blocks, 2 N blocks
    args = {"x": x, "w_q": w_q, "w_scale": w_scale, "block": (32, 16)}

    def call(**change):
        return lambda: fp8_block_gemv(**{**args, **change})

    too_many = torch.zeros(MAX_ROWS + 1, 64, device=DEVICE)
    return [
        (call(x=too_many), rf"^x: at most {MAX_ROWS} rows, got shape \({MAX_ROWS + 1}, 64\)$"),
        (call(x=x.int()), r"^x: dtype torch.int32 is not one of"),
        (call(x=x[:, :0]), r"^x: rows must not be empty"),
        (call(x=x.t().contiguous().t()), r"^x: last dim must be contiguous"),
        (call(block=(32, 24)), r"^block: must be a power of two >= 16, got 24$"),
        (call(w_q=w_q[:, :48]), r"^w_q: expected shape \(48, 64\), got \(48, 48\)$"),
        (call(w_q=w_q.float()), r"^w_q: dtype torch.float32 is not one of"),
        (call(w_scale=w_scale[:1]), r"^w_scale: expected shape \(2, 4\), got \(1, 4\)$"),
        (call(out=torch.empty(4, 48, dtype=torch.bfloat16, device=DEVICE)), r"^out: dtype torch.bfloat16"),
        (lambda: BlockGemvConfig(block_n=12), r"^block_n: must be a power of two >= 1, got 12$"),
        (lambda: BlockGemvConfig(groups=3), r"^groups: must be a power of two >= 1, got 3$"),
        (lambda: BlockGemvConfig(num_warps=3), r"^num_warps: must be 1, 2, 4, 8 or 16, got 3$"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_arguments())))
def test_bad_arguments_raise_naming_the_argument(index):
    call, message = _bad_arguments()[index]
    with pytest.raises(ValueError, match=message):
        call()
