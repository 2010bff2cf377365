"""The block-wise FP8 kernels (`sluice.kernels.fp8_block_mm`): `quantize_fp8_groups` writes, bit for bit,
the codes and scales of `fp8_blocks.quantize_activation_groups` (run on CPU), a partial last group, all-zero
groups, ties, subnormals, saturation and NaN included; `fp8_block_mm` equals `fp8_block_mm_reference` but for
the order of its fp32 sums, and that reference equals the dequantized product of `dequantize_blocks`;
`fp8_skinny_mm.fp8_block_skinny_mm` (the same product swapped and split over K, for up to 64 rows) too.
Outputs are poisoned first, so an element the kernel does not write fails. Under TRITON_INTERPRET=1 on CPU;
on a GPU, on CUDA."""

from __future__ import annotations

import pytest
import torch
from paged_batch import DEVICE, KERNEL_DTYPES

from sluice.engine.worker.layers.fp8_blocks import dequantize_blocks, quantize_activation_groups
from sluice.kernels.fp8_block_mm import (
    FP8,
    QUANT_TILE,
    fp8_block_mm,
    fp8_block_mm_reference,
    quantize_fp8_groups,
)
from sluice.kernels.fp8_skinny_mm import block_skinny_config, fp8_block_skinny_mm
from sluice.kernels.split_k import SkinnyConfig, split_counters

NAN_CODE = 0x7F  # e4m3fn NaN: the codes' poison (a finite input never quantizes to it)
MAX_CODE = 0x7E  # 448
SCALE_POISON = -1.0  # never a scale
# Hopper's fp8 tensor cores add a block's products in less than fp32; under the interpreter (and on the
# fp16 path of block_k 16) the sums are fp32 throughout, in another order than the reference's.
FP32_RTOL = 2e-3 if DEVICE.type == "cuda" else 1e-5


def _quantize(x, group_size, out=None, poison=NAN_CODE):
    """The kernel's (codes uint8, scales) on CPU, written into poisoned outputs (`out`: a given buffer)."""
    if out is None:
        out = torch.empty(x.shape, dtype=FP8, device=DEVICE)
    out.view(torch.uint8).fill_(poison)
    scale_out = torch.full((x.shape[0], -(-x.shape[1] // group_size)), SCALE_POISON, device=DEVICE)
    x_q, x_scale = quantize_fp8_groups(x, group_size, out=out, scale_out=scale_out)
    assert x_q is out and x_scale is scale_out
    return x_q.view(torch.uint8).cpu(), x_scale.cpu()


def _assert_bit_exact(x, group_size, out=None):
    codes, scale = _quantize(x, group_size, out)
    expected_codes, expected_scale = quantize_activation_groups(x.cpu(), group_size)
    assert torch.equal(scale.view(torch.int32), expected_scale.view(torch.int32))
    mismatch = (codes != expected_codes.view(torch.uint8)).nonzero()
    assert mismatch.numel() == 0, f"{len(mismatch)} codes differ, first at {mismatch[0].tolist()}"
    return codes, scale


def _random_rows(num_rows, width, dtype, seed=0):
    """Unit normals times a per-column magnitude from 1e-3 to 1e3 (each group its own scale)."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.linspace(-3, 3, width)[None, :]
    return (torch.randn(num_rows, width, generator=gen) * magnitudes).to(dtype).to(DEVICE)


# (K, group_size): a partial last group of 4; 7 groups, the last of 12; 17 groups over two programs
QUANT_SHAPES = [(100, 16), (300, 32), (QUANT_TILE + 40, 128)]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("num_rows", [1, 5, 33])
@pytest.mark.parametrize(("width", "group_size"), QUANT_SHAPES)
def test_codes_and_scales_are_quantize_activation_groups_bit_for_bit(dtype, num_rows, width, group_size):
    x = _random_rows(num_rows, width, dtype, seed=num_rows)
    codes, scale = _assert_bit_exact(x, group_size)
    assert scale.shape == (num_rows, -(-width // group_size))
    # every group's largest |x| is quantized to +-448: each group has its own scale
    padded = torch.nn.functional.pad(codes & 0x7F, (0, scale.shape[1] * group_size - width))
    assert (padded.view(num_rows, -1, group_size) == MAX_CODE).any(dim=2).all()


def _special_values() -> torch.Tensor:
    """Every non-negative e4m3 value, the midpoints between neighbours (ties: to even) and one ulp either
    side of them, values below e4m3's subnormals; both signs."""
    every_code = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = every_code[~every_code.isnan()].unique()
    values = values[values >= 0]
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    signed = torch.cat([values, near, torch.tensor([2.0**-12, 1e-30, 1e-40, 0.0])])
    return torch.cat([signed, -signed])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_ties_subnormals_zero_groups_and_saturation_round_like_torch(dtype):
    """Groups of 64: 448 then 63 special values (each group's scale 1, the values quantized as they are);
    row 1 is row 0 times 2^-20 (exact), row 2 times 3; row 3 has one all-zero group (scale float32 tiny,
    codes 0)."""
    special = _special_values()
    num_groups = -(-len(special) // 63)
    groups = torch.nn.functional.pad(special, (0, num_groups * 63 - len(special))).view(num_groups, 63)
    row = torch.cat([torch.full((num_groups, 1), 448.0), groups], dim=1).flatten()[:-20]  # a partial group
    zero_group = _random_rows(1, len(row), torch.float32, seed=7).cpu()[0]
    zero_group[64:128] = 0.0
    x = torch.stack([row, row * 2.0**-20, row * 3.0, zero_group]).to(dtype).to(DEVICE)
    codes, scale = _assert_bit_exact(x, 64)
    assert (scale[0] == 1.0).all() and scale[3, 1].item() == torch.finfo(torch.float32).tiny
    assert (codes[3, 64:128] == 0).all() and (codes[3, :64] != 0).any()
    magnitudes = codes[0] & 0x7F
    assert ((magnitudes > 0) & (magnitudes < 8)).any()  # e4m3 subnormals were made


def test_a_largest_value_a_hair_above_448_times_its_scale_saturates():
    """amax / 448 rounded down: amax / scale is just above 448 (checked, not assumed), clamped to 448."""
    largest = torch.tensor([448.0 * 0.7, 448.0 * 5.1])
    assert (largest / (largest / 448) > 448).all()
    x = _random_rows(2, 64, torch.float32, seed=6).cpu().clamp(-1, 1)
    x[:, 5] = largest
    x[:, 40] = -largest
    codes, _ = _assert_bit_exact(x.to(DEVICE), 32)
    assert (codes[:, 5] == MAX_CODE).all() and (codes[:, 40] == 0x80 | MAX_CODE).all()


def test_a_nan_makes_its_groups_scale_and_codes_nan_like_torchs_amax():
    x = _random_rows(3, 100, torch.float32)
    x[1, 37] = float("nan")  # group 2 of 32 columns
    codes, scale = _quantize(x, 32, poison=0x00)
    expected_codes, expected_scale = quantize_activation_groups(x.cpu(), 32)
    expected_codes = expected_codes.view(torch.uint8)
    assert scale[1, 1].isnan().item() and expected_scale[1, 1].isnan().item()
    assert ((codes[1, 32:64] & 0x7F) == NAN_CODE).all()
    assert ((expected_codes[1, 32:64] & 0x7F) == NAN_CODE).all()
    finite = torch.ones_like(codes, dtype=torch.bool)
    finite[1, 32:64] = False
    assert torch.equal(codes[finite], expected_codes[finite])
    assert torch.equal(scale.isnan(), expected_scale.isnan())
    assert torch.equal(scale.nan_to_num(), expected_scale.nan_to_num())


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_row_strided_input_and_output(dtype):
    width = 200
    x = _random_rows(3, width + 37, dtype, seed=1)[:, 5 : 5 + width]
    buffer = torch.full((3, width + 16), NAN_CODE, dtype=torch.uint8, device=DEVICE)
    out = buffer.view(FP8)[:, :width]
    assert x.stride(0) == width + 37 and out.stride(0) == width + 16
    _assert_bit_exact(x, 16, out=out)
    assert (buffer[:, width:] == NAN_CODE).all().item()  # the rows' tails: untouched


def test_no_rows_launch_nothing():
    x_q, x_scale = quantize_fp8_groups(torch.empty(0, 64, device=DEVICE), 32)
    assert x_q.shape == (0, 64) and x_q.dtype == FP8 and x_scale.shape == (0, 2)


def _mm_inputs(num_rows, out_features, in_features, block, seed=0):
    """Activations quantized per group (3 N(0, 1)); weight codes: random bytes, every e4m3 value but NaN;
    scales from 1e-2 to 1, one per block, so that a scale read from the wrong block fails."""
    gen = torch.Generator().manual_seed(seed)
    block_n, block_k = block
    x_q, x_scale = quantize_activation_groups(torch.randn(num_rows, in_features, generator=gen) * 3, block_k)
    w_q = torch.randint(0, 256, (out_features, in_features), generator=gen, dtype=torch.uint8)
    w_q[(w_q & 0x7F) == NAN_CODE] = 0x38  # 1.0
    scale_shape = (-(-out_features // block_n), -(-in_features // block_k))
    w_scale = 10.0 ** (torch.rand(scale_shape, generator=gen) * 2 - 2)
    return [t.to(DEVICE) for t in (x_q, x_scale, w_q.view(FP8), w_scale)]


def _block_mm(inputs, block, out_dtype):
    """The kernel's y (on CPU), written into a NaN-poisoned output."""
    out = torch.full((inputs[0].shape[0], inputs[2].shape[0]), float("nan"), dtype=out_dtype, device=DEVICE)
    y = fp8_block_mm(*inputs, block, out_dtype, out=out)
    assert y is out
    return y.cpu()


def _assert_matches_reference(got, inputs, block, out_dtype):
    cpu_inputs = [t.cpu() for t in inputs]
    want = fp8_block_mm_reference(*cpu_inputs, block, out_dtype).float()
    atol = FP32_RTOL * want.abs().max().item()
    # bf16: the same fp32 sums but for their order, each rounded once: at most one bf16 ulp apart
    rtol = 0.0 if out_dtype == torch.float32 else torch.finfo(out_dtype).eps
    assert got.dtype == out_dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


# (block_n, block_k), (N, K): neither a multiple of its block (a partial last K block and N block)
BLOCK_SHAPES = [((16, 16), (40, 72)), ((32, 16), (72, 56)), ((16, 32), (50, 100))]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows", [1, 5, 33])
@pytest.mark.parametrize(("block", "shape"), BLOCK_SHAPES)
def test_block_mm_matches_the_reference(block, shape, num_rows, out_dtype):
    inputs = _mm_inputs(num_rows, *shape, block, seed=num_rows)
    _assert_matches_reference(_block_mm(inputs, block, out_dtype), inputs, block, out_dtype)


@pytest.mark.parametrize("num_rows", [1, 5])
def test_block_mm_of_128_by_128_blocks(num_rows):
    """The checkpoints' blocks: N 200 (two N blocks, the second partial), K 300 (three K blocks)."""
    block = (128, 128)
    inputs = _mm_inputs(num_rows, 200, 300, block, seed=10 + num_rows)
    _assert_matches_reference(_block_mm(inputs, block, torch.bfloat16), inputs, block, torch.bfloat16)


def test_block_mm_row_strided_operands_and_output():
    block = (16, 32)
    x_q, x_scale, w_q, w_scale = _mm_inputs(9, 48, 80, block, seed=3)
    wide_x = torch.zeros(9, 96, dtype=torch.uint8, device=DEVICE)
    wide_x[:, 8:88] = x_q.view(torch.uint8)
    wide_w = torch.zeros(48, 112, dtype=torch.uint8, device=DEVICE)
    wide_w[:, :80] = w_q.view(torch.uint8)
    strided = (wide_x.view(FP8)[:, 8:88], x_scale, wide_w.view(FP8)[:, :80], w_scale)
    buffer = torch.full((9, 64), float("nan"), device=DEVICE)
    y = fp8_block_mm(*strided, block, torch.float32, out=buffer[:, :48])
    assert y.stride(0) == 64 and buffer[:, 48:].isnan().all()
    _assert_matches_reference(y.cpu(), (x_q, x_scale, w_q, w_scale), block, torch.float32)


@pytest.mark.parametrize(("block", "shape"), [*BLOCK_SHAPES, ((128, 128), (200, 300))])
def test_the_reference_is_the_dequantized_product(block, shape):
    """Activations times their group scales, @ `dequantize_blocks`' w^T: the CPU path's numbers, each
    product rounded in another place."""
    x_q, x_scale, w_q, w_scale = (t.cpu() for t in _mm_inputs(7, *shape, block, seed=4))
    in_features = x_q.shape[1]
    x = x_q.float() * x_scale.repeat_interleave(block[1], dim=1)[:, :in_features]
    want = x @ dequantize_blocks(w_q, w_scale, block).t()
    got = fp8_block_mm_reference(x_q, x_scale, w_q, w_scale, block, torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_quantized_by_the_kernel_and_multiplied_by_the_kernel():
    x = _random_rows(5, 100, torch.bfloat16, seed=5)
    _, _, w_q, w_scale = _mm_inputs(5, 40, 100, (16, 32), seed=5)
    x_q, x_scale = quantize_fp8_groups(x, 32)
    inputs = (x_q, x_scale, w_q, w_scale)
    _assert_matches_reference(_block_mm(inputs, (16, 32), torch.bfloat16), inputs, (16, 32), torch.bfloat16)


def test_no_rows_or_outputs_launch_nothing():
    x_q, x_scale, w_q, w_scale = _mm_inputs(0, 32, 64, (16, 16))
    assert fp8_block_mm(x_q, x_scale, w_q, w_scale, (16, 16)).shape == (0, 32)
    x_q, x_scale, w_q, w_scale = _mm_inputs(3, 0, 64, (16, 16))
    assert fp8_block_mm(x_q, x_scale, w_q, w_scale, (16, 16), torch.float32).shape == (3, 0)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("num_rows", [2, 64])  # the MMA's narrow side padded to 16, and its widest, 64
@pytest.mark.parametrize(("block", "shape"), BLOCK_SHAPES)
def test_block_skinny_mm_matches_the_reference(block, shape, num_rows, split_k, out_dtype):
    """Split K in whole K blocks (K 72 / 56 / 100 in 4 splits: 3 / 4 / 2 splits of 32 / 16 / 64 columns, the
    last partial), each split's sums already scaled, added by the reduce unscaled."""
    inputs = _mm_inputs(num_rows, *shape, block, seed=20 + num_rows)
    config = SkinnyConfig(block_n=32, block_k=block[1], split_k=split_k)
    got = fp8_block_skinny_mm(*inputs, block, out_dtype, config)
    assert got.shape == (num_rows, shape[0])
    _assert_matches_reference(got.cpu(), inputs, block, out_dtype)


@pytest.mark.parametrize(("block", "shape"), BLOCK_SHAPES)
def test_block_skinny_mm_fused_reduce_is_bit_for_bit_the_reduce_launch(block, shape):
    """The splits' sums, scaled already, added by each channel block's last split (`fused_reduce`) as the
    reduce launch adds them: the same bits, and the counters back at zero."""
    inputs = _mm_inputs(3, *shape, block, seed=40)
    want = fp8_block_skinny_mm(*inputs, block, config=SkinnyConfig(block_n=32, block_k=block[1], split_k=4))
    fused = SkinnyConfig(block_n=32, block_k=block[1], split_k=4, fused_reduce=True)
    assert torch.equal(fp8_block_skinny_mm(*inputs, block, config=fused), want)
    assert not split_counters(want.device, 1).any()


@pytest.mark.parametrize("num_rows", [2, 16])
def test_block_skinny_mm_of_128_by_128_blocks_with_its_default_config(num_rows):
    block = (128, 128)
    inputs = _mm_inputs(num_rows, 200, 300, block, seed=30 + num_rows)
    got = fp8_block_skinny_mm(*inputs, block)
    _assert_matches_reference(got.cpu(), inputs, block, torch.bfloat16)
    quantized = quantize_fp8_groups(_random_rows(num_rows, 300, torch.bfloat16, seed=num_rows), 128)
    both = (*quantized, *inputs[2:])
    _assert_matches_reference(fp8_block_skinny_mm(*both, block).cpu(), both, block, torch.bfloat16)


def test_the_block_config_splits_whole_blocks_until_every_sm_has_work():
    assert block_skinny_config(4096, 4096, 132, 128) == SkinnyConfig(split_k=4)  # 64 tiles x 4 >= 198
    assert block_skinny_config(28672, 4096, 132, 128) == SkinnyConfig(split_k=1)  # 448 tiles
    assert block_skinny_config(4096, 512, 132, 128) == SkinnyConfig(split_k=4)  # 4 splits of one block
    assert block_skinny_config(4096, 256, 132, 64) == SkinnyConfig(block_k=64, split_k=4)
    assert block_skinny_config(64, 64, 132, 16) == SkinnyConfig(block_k=16, split_k=4)


def test_block_skinny_mm_no_rows_or_outputs_launch_nothing():
    x_q, x_scale, w_q, w_scale = _mm_inputs(0, 32, 64, (16, 16))
    assert fp8_block_skinny_mm(x_q, x_scale, w_q, w_scale, (16, 16)).shape == (0, 32)
    x_q, x_scale, w_q, w_scale = _mm_inputs(3, 0, 64, (16, 16))
    assert fp8_block_skinny_mm(x_q, x_scale, w_q, w_scale, (16, 16), torch.float32).shape == (3, 0)


def _bad_arguments():
    x = torch.randn(4, 64, device=DEVICE)
    fp8 = torch.empty(4, 64, dtype=FP8, device=DEVICE)
    meta = torch.device("meta")
    x_q, x_scale, w_q, w_scale = _mm_inputs(4, 48, 64, (32, 16))  # 4 K blocks, 2 N blocks
    narrow_out = torch.empty(4, 40, dtype=torch.bfloat16, device=DEVICE)
    mm = {"x_q": x_q, "x_scale": x_scale, "w_q": w_q, "w_scale": w_scale, "block": (32, 16)}

    def call(**change):
        return lambda: fp8_block_mm(**{**mm, **change})

    def skinny(**change):
        return lambda: fp8_block_skinny_mm(**{**mm, **change})

    many_rows = _mm_inputs(65, 48, 64, (32, 16))

    return [
        (lambda: quantize_fp8_groups(x[None], 16), r"^x: expected 2 dims, got shape \(1, 4, 64\)$"),
        (lambda: quantize_fp8_groups(x.int(), 16), r"^x: dtype torch.int32 is not one of"),
        (lambda: quantize_fp8_groups(x.t(), 16), r"^x: last dim must be contiguous"),
        (lambda: quantize_fp8_groups(x[:, :0], 16), r"^x: rows must not be empty"),
        (lambda: quantize_fp8_groups(x, 24), r"^group_size: must be a power of two >= 16, got 24$"),
        (lambda: quantize_fp8_groups(x, 8), r"^group_size: must be a power of two >= 16, got 8$"),
        (lambda: quantize_fp8_groups(x, 16, out=fp8.view(torch.uint8)), r"^out: dtype torch.uint8 is not"),
        (lambda: quantize_fp8_groups(x, 16, out=fp8[:, :32]), r"^out: expected shape \(4, 64\), got"),
        (lambda: quantize_fp8_groups(x, 16, out=fp8.to(meta)), r"^out: on meta"),
        (
            lambda: quantize_fp8_groups(x, 16, scale_out=torch.ones(4, 1, device=DEVICE)),
            r"^scale_out: expected shape \(4, 4\), got \(4, 1\)$",
        ),
        (call(x_q=x_q.float()), r"^x_q: dtype torch.float32 is not one of"),
        (call(x_q=x_q[:, :0]), r"^x_q: rows must not be empty"),
        (call(block=(32, 24)), r"^block: must be a power of two >= 16, got 24$"),
        (call(block=[32, 16]), r"^block: expected \(block_n, block_k\), got \[32, 16\]$"),
        (call(w_q=w_q[:, :48]), r"^w_q: expected shape \(48, 64\), got \(48, 48\)$"),
        (call(w_q=w_q.t()), r"^w_q: last dim must be contiguous"),
        (call(w_q=w_q.to(meta)), r"^w_q: on meta, expected"),
        (call(x_scale=x_scale[:, :3]), r"^x_scale: expected shape \(4, 4\), got \(4, 3\)$"),
        (call(x_scale=x_scale.half()), r"^x_scale: dtype torch.float16 is not one of"),
        (call(w_scale=w_scale[:1]), r"^w_scale: expected shape \(2, 4\), got \(1, 4\)$"),
        (call(w_scale=w_scale.t().contiguous().t()), r"^w_scale: last dim must be contiguous"),
        (call(out_dtype=torch.int32), r"^out_dtype: torch.int32 is not one of"),
        (call(out=torch.empty(4, 48, device=DEVICE)), r"^out: dtype torch.float32 is not one of"),
        (call(out=narrow_out), r"^out: expected shape \(4, 48\), got \(4, 40\)$"),
        (skinny(x_scale=x_scale[:, :3]), r"^x_scale: expected shape \(4, 4\), got \(4, 3\)$"),
        (skinny(block=(32, 24)), r"^block: must be a power of two >= 16, got 24$"),
        (skinny(x_q=many_rows[0], x_scale=many_rows[1]), r"^x_q: at most 64 rows, got 65$"),
        (skinny(config=SkinnyConfig(block_k=32)), r"^config: block_k 32 must be the blocks' 16$"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_arguments())))
def test_bad_arguments_raise_naming_the_argument(index):
    call, message = _bad_arguments()[index]
    with pytest.raises(ValueError, match=message):
        call()
