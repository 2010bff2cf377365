"""The FP8 activation-quantization kernel (`sluice.kernels.fp8_quant`) writes, bit for bit, the codes and
scales of `fp8_linear.quantize_activations` (the CPU reference, run on CPU): per token (bf16/fp16/fp32, one
row and several, one tile and the two-pass loop over wide rows, row-strided input and output) and static
(a [] or [1] input_scale read on the device). Special rows: all zeros, every e4m3 value with the midpoints
between neighbours (ties) and one ulp either side, e4m3's subnormals, saturation, NaN. Outputs are poisoned
first, so an element the kernel does not write fails. Then `Fp8LinearMethod`: on the `_scaled_mm` matmuls
(torch runs them on CPU too) the kernel quantizes, and y is bit for bit what `quantize_activations` into the
same matmul gives. Under TRITON_INTERPRET=1 on CPU; on a GPU, on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import fp8_layer
from paged_batch import DEVICE, KERNEL_DTYPES

from sluice.engine.loading.fp8_config import Fp8Scheme
from sluice.engine.worker.layers.fp8_linear import (
    FP8,
    FP8_MATMULS,
    SKINNY_MAX_ROWS,
    Fp8LinearMethod,
    quantize_activations,
)
from sluice.engine.worker.layers.linear import ReplicatedLinear
from sluice.kernels.fp8_quant import MAX_TILE, quantize_fp8_per_token, quantize_fp8_static

NAN_CODE = 0x7F  # e4m3fn NaN: the poison of the codes (a finite input never quantizes to it)
SCALE_POISON = -1.0  # never a scale
MAX_CODE = 0x7E  # 448
WIDTHS = [300, MAX_TILE, 2 * MAX_TILE + 300]  # one tile (not a power of two), a full tile, the loop


def _quantize(x, input_scale=None, poison=NAN_CODE, out=None):
    """The kernel's (codes [M, K] uint8, scale [M, 1]) into poisoned outputs (`out`: a given code buffer)."""
    if out is None:
        out = torch.empty(x.shape, dtype=FP8, device=DEVICE)
    out.view(torch.uint8).fill_(poison)
    scale_out = torch.full((x.shape[0], 1), SCALE_POISON, device=DEVICE)
    if input_scale is None:
        x_q, scale = quantize_fp8_per_token(x, out=out, scale_out=scale_out)
    else:
        x_q, scale = quantize_fp8_static(x, input_scale, out=out, scale_out=scale_out)
    assert x_q is out and scale is scale_out
    return x_q.view(torch.uint8).cpu(), scale.cpu()


def _reference(x, input_scale=None):
    """quantize_activations on CPU: (codes [M, K] uint8, scale [M, 1] float32)."""
    if input_scale is None:
        x_q, scale = quantize_activations(x.cpu(), "token")
    else:
        x_q, scale = quantize_activations(x.cpu(), "static", input_scale.cpu())
    return x_q.view(torch.uint8), scale.expand(x.shape[0], 1)


def _assert_bit_exact(x, input_scale=None, out=None):
    codes, scale = _quantize(x, input_scale, out=out)
    expected_codes, expected_scale = _reference(x, input_scale)
    assert torch.equal(scale.view(torch.int32), expected_scale.view(torch.int32))
    mismatch = (codes != expected_codes).nonzero()
    assert mismatch.numel() == 0, f"{len(mismatch)} codes differ, first at {mismatch[0].tolist()}"
    return codes, scale


def _random_rows(num_rows, width, dtype, seed=0):
    """Unit normals times a per-row magnitude from 1e-3 to 1e3."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.linspace(-3, 3, num_rows)[:, None]
    return (torch.randn(num_rows, width, generator=gen) * magnitudes).to(dtype).to(DEVICE)


def _special_values() -> torch.Tensor:
    """448 (so a row's scale is 1), every other non-negative e4m3 value, the midpoints between neighbours
    (ties: to even) and one ulp either side of them, e4m3 subnormals and values below them; both signs."""
    every_code = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = every_code[~every_code.isnan()].unique()
    values = values[values >= 0]
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    small = torch.tensor([2.0**-10, 2.0**-12, 3 * 2.0**-11, 1e-30, 1e-40, 0.0])
    signed = torch.cat([values, near, small])
    return torch.cat([torch.tensor([448.0]), signed, -signed])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("width", WIDTHS)
def test_per_token_codes_and_scales_are_quantize_activations_bit_for_bit(dtype, num_rows, width):
    x = _random_rows(num_rows, width, dtype)
    codes, _ = _assert_bit_exact(x)
    # each row's largest |x| is quantized to +-448: the scale is its row's
    assert ((codes & 0x7F) == MAX_CODE).any(dim=1).all()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("width", [None, 2 * MAX_TILE + 7])
def test_ties_subnormals_and_saturation_round_like_torch(dtype, width):
    """Row 0 has scale 1: the special values are quantized as they are (ties, subnormals); row 1 is row 0
    times 2^-20 (exact: the same codes, fp16 aside); row 2 times 3; row 3 all zeros (scale float32 tiny,
    codes 0). `width` repeats the values over a row wider than a tile."""
    row = _special_values()
    if width is not None:
        row = row.repeat(width // len(row) + 1)[:width]
    x = torch.stack([row, row * 2.0**-20, row * 3.0, torch.zeros_like(row)]).to(dtype).to(DEVICE)
    codes, scale = _assert_bit_exact(x)
    assert scale[0].item() == 1.0 and scale[3].item() == torch.finfo(torch.float32).tiny
    assert (codes[3] == 0).all()
    magnitudes = codes[0] & 0x7F
    assert ((magnitudes > 0) & (magnitudes < 8)).any()  # e4m3 subnormals were made
    assert (codes[0] == MAX_CODE).any() and (codes[0] == 0x80 | MAX_CODE).any()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("width", WIDTHS[::2])
def test_row_strided_input_and_output(dtype, width):
    base = _random_rows(3, width + 37, dtype, seed=1)
    x = base[:, 5 : 5 + width]
    buffer = torch.full((3, width + 16), NAN_CODE, dtype=torch.uint8, device=DEVICE)
    out = buffer.view(FP8)[:, :width]
    assert x.stride(0) == width + 37 and out.stride(0) == width + 16
    _assert_bit_exact(x, out=out)
    assert (buffer[:, width:] == NAN_CODE).all().item()  # the rows' tails: untouched


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("input_scale", [torch.tensor(0.02), torch.tensor([3.0]), torch.tensor(1.0)])
@pytest.mark.parametrize("width", WIDTHS[::2])
def test_static_scale_codes_are_quantize_activations_bit_for_bit(dtype, input_scale, width):
    """Row 0 the special values, row 1 4 N(0, 1) with a few large and small values: under each scale some
    saturate and some fall into e4m3's subnormals; checked, not assumed."""
    rows = torch.randn(2, width, generator=torch.Generator().manual_seed(2)) * 4
    special = _special_values()[:width]
    rows[0, : len(special)] = special
    rows[1, :7] = torch.tensor([1e4, -2000.0, 500.0, 1e-4, -2.5e-4, 0.01, -0.03])
    x = rows.to(dtype).to(DEVICE)
    input_scale = input_scale.to(DEVICE)
    codes, scale = _assert_bit_exact(x, input_scale)
    assert (scale == input_scale.cpu().reshape(())).all()
    magnitudes = codes & 0x7F
    assert (magnitudes == MAX_CODE).any() and ((magnitudes > 0) & (magnitudes < 8)).any()


def test_a_nan_makes_its_rows_scale_and_codes_nan_like_torchs_amax():
    x = _random_rows(3, 300, torch.float32)
    x[1, 17] = float("nan")
    codes, scale = _quantize(x, poison=0x00)
    expected_codes, expected_scale = _reference(x)
    assert scale[1].isnan().item() and expected_scale[1].isnan().item()
    assert ((codes[1] & 0x7F) == NAN_CODE).all() and ((expected_codes[1] & 0x7F) == NAN_CODE).all()
    rows = [0, 2]
    assert torch.equal(codes[rows], expected_codes[rows]) and torch.equal(scale[rows], expected_scale[rows])


def test_no_rows_launch_nothing():
    x_q, scale = quantize_fp8_per_token(torch.empty(0, 64, device=DEVICE))
    assert x_q.shape == (0, 64) and x_q.dtype == FP8 and scale.shape == (0, 1)


def _bad_arguments():
    x = torch.randn(4, 64, device=DEVICE)
    one = torch.tensor(1.0, device=DEVICE)
    meta = torch.device("meta")
    fp8 = torch.empty(4, 64, dtype=FP8, device=DEVICE)
    return [
        (lambda: quantize_fp8_per_token(x[None]), r"^x: expected 2 dims, got shape \(1, 4, 64\)$"),
        (lambda: quantize_fp8_per_token(x.int()), r"^x: dtype torch.int32 is not one of"),
        (lambda: quantize_fp8_per_token(x.t()), r"^x: last dim must be contiguous"),
        (lambda: quantize_fp8_per_token(x[:, :0]), r"^x: rows must not be empty"),
        (lambda: quantize_fp8_per_token(x, out=fp8.view(torch.uint8)), r"^out: dtype torch.uint8 is not"),
        (lambda: quantize_fp8_per_token(x, out=fp8[:, :32]), r"^out: expected shape \(4, 64\), got"),
        (lambda: quantize_fp8_per_token(x, out=fp8.to(meta)), r"^out: on meta"),
        (lambda: quantize_fp8_per_token(x, scale_out=one.expand(4, 1).half()), r"^scale_out: dtype"),
        (lambda: quantize_fp8_per_token(x, scale_out=one.expand(4)), r"^scale_out: expected 2 dims"),
        (lambda: quantize_fp8_static(x, 0.5), r"^input_scale: expected a torch.Tensor, got float$"),
        (lambda: quantize_fp8_static(x, one.expand(2)), r"^input_scale: expected shape \(\) or \(1,\)"),
        (lambda: quantize_fp8_static(x, one.double()), r"^input_scale: dtype torch.float64 must match"),
        (lambda: quantize_fp8_static(x, one.to(meta)), r"^input_scale: on meta, expected"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_arguments())))
def test_bad_arguments_raise_naming_the_argument(index):
    call, message = _bad_arguments()[index]
    with pytest.raises(ValueError, match=message):
        call()


def _layer(matmul: str, dtype: torch.dtype, activations: str) -> ReplicatedLinear:
    """A 64 -> 32 FP8 layer with a bias (a static one: serialized, input_scale 0.01) running `matmul`."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    return fp8_layer(weight, matmul, dtype, activations, bias=bias, device=DEVICE)


@pytest.mark.parametrize(
    ("matmul", "dtype"),
    [("rowwise", torch.bfloat16), ("tensorwise", torch.float16), ("tensorwise", torch.float32)],
)
@pytest.mark.parametrize("activations", ["token", "static"])
def test_scaled_mm_layers_quantize_with_the_kernel_and_get_the_same_y(matmul, dtype, activations):
    layer = _layer(matmul, dtype, activations)
    method = layer.method
    assert method.quantizes_in_kernel
    calls = []
    kernel = method._quantize_fp8
    method._quantize_fp8 = lambda x, *args: calls.append(x.shape) or kernel(x, *args)
    rows = 2 * (SKINNY_MAX_ROWS // 2 + 1)  # more than `fp8_skinny_mm` takes: quantized, then `_scaled_mm`
    x = _random_rows(rows, 64, dtype, seed=3).view(2, rows // 2, 64)
    y = layer(x)
    assert calls == [(rows, 64)]
    input_scale = getattr(layer, "input_scale", None)
    # The reference quantizes on CPU, as the other tests here: torch on CUDA divides by a Python scalar
    # (amax / 448) as a product with its reciprocal, which can miss the IEEE quotient by an ulp (on the
    # H100 the float32 layer's y then differed); the kernel and the CPU path divide exactly.
    x_q, x_scale = quantize_activations(
        x.view(rows, 64).cpu(), activations, None if input_scale is None else input_scale.cpu()
    )
    expected = FP8_MATMULS[matmul](layer, x_q.to(DEVICE), x_scale.to(DEVICE)).view(x.shape[:-1] + (32,))
    expected = expected + layer.bias
    assert y.dtype == dtype and torch.equal(y, expected)


def test_the_emulated_path_and_dynamic_tensor_scales_keep_quantize_activations():
    assert not _layer("emulated", torch.float32, "token").method.quantizes_in_kernel
    assert not _layer("emulated", torch.float32, "static").method.quantizes_in_kernel
    tensor_scheme = Fp8Scheme("channel", "tensor", serialized=True)
    assert not Fp8LinearMethod(tensor_scheme, "rowwise").quantizes_in_kernel
