"""RMSNorm and SiLU-and-mul with the FP8 activation quantization fused in (`rms_norm_fp8_quant`,
`silu_and_mul_fp8_quant`) write, bit for bit, the codes and scales of the two launches they replace:
`rms_norm` (or `silu_and_mul`) then `fp8_quant.quantize_fp8`, and the same residual_out. Per token and
static, bf16 / fp16 / fp32, with and without a residual, rows 1 to 67, widths not powers of two, rows wider
than fp8_quant's tile (SiLU-and-mul's two passes), all-zero rows, saturation, NaN and inf. With a
group_size (block FP8's activations), the codes and group scales of `fp8_block_mm.quantize_fp8_groups`
instead: partial last groups, a group wider than the row, rows of several programs. Outputs are poisoned
first, so an element the kernel does not write fails. Under TRITON_INTERPRET=1 on CPU; on a GPU, on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from paged_batch import DEVICE, KERNEL_DTYPES
from test_kernels_attention import GridRecorder

from sluice.kernels import rms_norm as rms_norm_module
from sluice.kernels import silu_and_mul as silu_and_mul_module
from sluice.kernels.fp8_block_mm import quantize_fp8_groups
from sluice.kernels.fp8_quant import quantize_fp8
from sluice.kernels.rms_norm import rms_norm, rms_norm_fp8_quant
from sluice.kernels.silu_and_mul import FP8_MAX_TILE, silu_and_mul, silu_and_mul_fp8_quant

FP8 = torch.float8_e4m3fn
CODE_POISON = 0x7F  # e4m3fn NaN: a finite input never quantizes to it
SCALE_POISON = -1.0  # never a scale
MAX_CODE = 0x7E  # 448
STATIC_SCALE = 0.005
EPS = 1e-5


def _rows(num_rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Unit normals times a per-row magnitude from 1e-2 to 10; row 1 (when there is one) all zeros."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.linspace(-2, 1, num_rows)[:, None]
    x = torch.randn(num_rows, width, generator=gen) * magnitudes
    if num_rows > 1:
        x[1] = 0.0
    return x.to(dtype).to(DEVICE)


def _poisoned(num_rows: int, width: int, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.full((num_rows, width), CODE_POISON, dtype=torch.uint8, device=DEVICE).view(FP8)
    scales = 1 if group_size is None else -(-width // group_size)
    return codes, torch.full((num_rows, scales), SCALE_POISON, device=DEVICE)


def _input_scale(static: bool) -> torch.Tensor | None:
    return torch.tensor(STATIC_SCALE, device=DEVICE) if static else None


def _assert_same_bits(fused: tuple[torch.Tensor, torch.Tensor], unfused: tuple[torch.Tensor, torch.Tensor]):
    (codes, scale), (expected_codes, expected_scale) = fused, unfused
    assert codes.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == expected_scale.shape
    assert torch.equal(scale.view(torch.int32), expected_scale.view(torch.int32))
    codes, expected_codes = codes.view(torch.uint8), expected_codes.view(torch.uint8)
    mismatch = (codes != expected_codes).nonzero()
    assert mismatch.numel() == 0, f"{len(mismatch)} codes differ, first at {mismatch[0].tolist()}"


def _rms_norm_both(x, weight, residual, input_scale):
    """(fused codes, scale, residual_out) into poisoned outputs, and the unfused ones."""
    codes, scale = _poisoned(*x.shape)
    residual_out = None if residual is None else torch.full_like(x, float("nan"))
    fused = rms_norm_fp8_quant(
        x, weight, EPS, residual, input_scale, out=codes, scale_out=scale, residual_out=residual_out
    )
    assert fused[0] is codes and fused[1] is scale
    normed, expected_residual = rms_norm(x, weight, EPS, residual)
    return fused, (*quantize_fp8(normed, input_scale), expected_residual)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(("num_rows", "hidden"), [(1, 300), (5, 1000), (67, 96)])
def test_rms_norm_fp8_quant_is_rms_norm_then_quantize_bit_for_bit(
    dtype, has_residual, static, num_rows, hidden
):
    x = _rows(num_rows, hidden, dtype, seed=0)
    residual = _rows(num_rows, hidden, dtype, seed=1) if has_residual else None
    weight = (1.0 + torch.randn(hidden, generator=torch.Generator().manual_seed(2))).to(dtype).to(DEVICE)
    fused, unfused = _rms_norm_both(x, weight, residual, _input_scale(static))
    _assert_same_bits(fused[:2], unfused[:2])
    assert torch.equal(fused[2], unfused[2])
    assert fused[2] is x if residual is None else fused[2].data_ptr() != x.data_ptr()
    codes = fused[0].view(torch.uint8)
    if static:  # 0.005: the largest |normed| (~4) saturate
        assert (fused[1] == STATIC_SCALE).all() and ((codes & 0x7F) == MAX_CODE).any()
    else:  # each row's largest |normed| is +-448, but an all-zero one (no residual): scale tiny, codes 0
        nonzero = fused[0].float().abs().amax(dim=1) > 0
        assert ((codes & 0x7F) == MAX_CODE).any(dim=1).tolist() == nonzero.tolist()
        if num_rows > 1 and not has_residual:
            assert not nonzero[1] and fused[1][1].item() == torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("static", [False, True])
def test_rms_norm_fp8_quant_on_more_warps_is_rms_norm_on_as_many_then_quantize(static, monkeypatch):
    """`warps=` (the kernel bench's other launch): 32 warps on a row `norm_warps` gives 4 (640 columns
    padded to 1024), bit for bit `rms_norm` on 32 warps then `quantize_fp8` (on a GPU another warp count
    may sum the squares in another order)."""
    launches = GridRecorder(rms_norm_module._rms_norm_kernel)
    monkeypatch.setattr(rms_norm_module, "_rms_norm_kernel", launches)
    x, residual = _rows(3, 640, torch.bfloat16, seed=8), _rows(3, 640, torch.bfloat16, seed=9)
    weight = (1.0 + torch.randn(640, generator=torch.Generator().manual_seed(10))).bfloat16().to(DEVICE)
    codes, scale = _poisoned(3, 640)
    fused = rms_norm_fp8_quant(
        x, weight, EPS, residual, _input_scale(static), out=codes, scale_out=scale, warps=32
    )
    normed, residual_out = rms_norm(x, weight, EPS, residual, warps=32)
    rms_norm(x, weight, EPS, residual)
    # the default: one warp per 256 padded columns
    assert [kwargs["num_warps"] for kwargs in launches.constexprs] == [32, 32, 4]
    _assert_same_bits(fused[:2], quantize_fp8(normed, _input_scale(static)))
    assert torch.equal(fused[2], residual_out)


# NaN and inf inputs on purpose: the interpreter's numpy says so
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_rms_norm_fp8_quant_nan_and_inf_rows_as_the_unfused_path(dtype, static):
    x = _rows(4, 200, dtype, seed=3)
    x[0, 7] = float("nan")
    x[2, 11] = float("inf")  # sum of squares inf: rsqrt 0, the row 0 but inf * 0 = NaN at column 11
    weight = torch.ones(200, dtype=dtype, device=DEVICE)
    fused, unfused = _rms_norm_both(x, weight, None, _input_scale(static))
    codes, expected_codes = fused[0].view(torch.uint8), unfused[0].view(torch.uint8)
    assert torch.equal(codes, expected_codes)
    assert torch.equal(fused[1].isnan(), unfused[1].isnan())
    finite = ~unfused[1].isnan()
    assert torch.equal(fused[1][finite], unfused[1][finite])
    assert ((codes[0] & 0x7F) == 0x7F).all() and (codes[2, 11] & 0x7F) == 0x7F  # NaN in: NaN codes
    if static:
        assert ((codes[2, :11] & 0x7F) == 0).all() and (fused[1] == STATIC_SCALE).all()
    else:  # a NaN amax: the row's scale and all its codes NaN
        assert fused[1][[0, 2]].isnan().all() and not fused[1][[1, 3]].isnan().any()
        assert ((codes[2] & 0x7F) == 0x7F).all()


def _group_maxima(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """[rows, groups] bool: whether each group holds a code of magnitude 448 (its amax)."""
    at_max = (codes.view(torch.uint8) & 0x7F) == MAX_CODE
    padded = torch.nn.functional.pad(at_max, (0, -at_max.shape[1] % group_size))
    return padded.view(at_max.shape[0], -1, group_size).any(dim=2)


def _rms_norm_groups_both(x, weight, residual, group_size):
    codes, scale = _poisoned(*x.shape, group_size)
    fused = rms_norm_fp8_quant(x, weight, EPS, residual, out=codes, scale_out=scale, group_size=group_size)
    assert fused[0] is codes and fused[1] is scale
    normed, expected_residual = rms_norm(x, weight, EPS, residual)
    return fused, (*quantize_fp8_groups(normed, group_size), expected_residual)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("has_residual", [False, True])
# partial last group; groups of 16; a group wider than the row's power of two (one partial group)
@pytest.mark.parametrize(("num_rows", "hidden", "group_size"), [(1, 300, 128), (5, 1000, 16), (67, 40, 128)])
def test_rms_norm_fp8_quant_in_groups_is_rms_norm_then_quantize_fp8_groups_bit_for_bit(
    dtype, has_residual, num_rows, hidden, group_size
):
    x = _rows(num_rows, hidden, dtype, seed=0)
    residual = _rows(num_rows, hidden, dtype, seed=1) if has_residual else None
    weight = (1.0 + torch.randn(hidden, generator=torch.Generator().manual_seed(2))).to(dtype).to(DEVICE)
    fused, unfused = _rms_norm_groups_both(x, weight, residual, group_size)
    assert fused[1].shape == (num_rows, -(-hidden // group_size))
    _assert_same_bits(fused[:2], unfused[:2])
    assert torch.equal(fused[2], unfused[2])
    nonzero = fused[0].float().abs().view(num_rows, -1)  # each nonzero group's largest |code| is 448
    nonzero = torch.nn.functional.pad(nonzero, (0, -hidden % group_size)).view(num_rows, -1, group_size)
    assert torch.equal(_group_maxima(fused[0], group_size), nonzero.amax(dim=2) > 0)


@pytest.mark.parametrize(("hidden", "group_size"), [(40, 128), (300, 128), (1000, 16)])
def test_rms_norm_fp8_quant_in_groups_sums_the_squares_as_rms_norm_does(hidden, group_size, monkeypatch):
    """The fused launch pads the row to `rms_norm`'s width and runs its warps, also with a group wider than
    the padded row (one group): on a GPU the sum of squares is reduced over the threads holding the padded
    row, so a wider pad summed it in another order (40 columns in groups of 128, fp32: one scale an ulp
    off in run 16's kernel tests on an H200; the interpreter sums it as numpy does, either way)."""
    launches = GridRecorder(rms_norm_module._rms_norm_kernel)
    monkeypatch.setattr(rms_norm_module, "_rms_norm_kernel", launches)
    x = _rows(3, hidden, torch.float32, seed=0)
    weight = torch.ones(hidden, device=DEVICE)
    fused = rms_norm_fp8_quant(x, weight, EPS, group_size=group_size)
    normed, _ = rms_norm(x, weight, EPS)
    fused_launch, norm_launch = launches.constexprs
    for key in ("HIDDEN_PAD", "num_warps"):
        assert fused_launch[key] == norm_launch[key], key
    _assert_same_bits(fused[:2], quantize_fp8_groups(normed, group_size))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_rms_norm_fp8_quant_in_groups_nan_stays_in_its_group(dtype):
    x = _rows(3, 200, dtype, seed=3)
    x[0, 70] = float("nan")  # group 2 of 64; the norm spreads it over row 0's groups: all NaN
    weight = torch.ones(200, dtype=dtype, device=DEVICE)
    weight[130] = float("nan")  # column 130 (group 2) of every row NaN after the norm
    fused, unfused = _rms_norm_groups_both(x, weight, None, 64)
    assert torch.equal(fused[0].view(torch.uint8), unfused[0].view(torch.uint8))
    assert torch.equal(fused[1].isnan(), unfused[1].isnan())
    assert fused[1][0].isnan().all()
    assert fused[1][1:, 2].isnan().all() and not fused[1][1:, [0, 1, 3]].isnan().any()
    assert torch.equal(fused[1][1:, [0, 1, 3]], unfused[1][1:, [0, 1, 3]])


def _silu_both(x, input_scale):
    codes, scale = _poisoned(x.shape[0], x.shape[1] // 2)
    fused = silu_and_mul_fp8_quant(x, input_scale, out=codes, scale_out=scale)
    assert fused[0] is codes and fused[1] is scale
    return fused, quantize_fp8(silu_and_mul(x), input_scale)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("static", [False, True])
# llama-3-8b's 14,336 columns in one tile; past FP8_MAX_TILE, two passes over two tiles
@pytest.mark.parametrize(("num_rows", "d"), [(1, 300), (67, 88), (3, 14336), (2, FP8_MAX_TILE + 300)])
def test_silu_and_mul_fp8_quant_is_silu_and_mul_then_quantize_bit_for_bit(dtype, static, num_rows, d):
    x = _rows(num_rows, 2 * d, dtype, seed=4)
    # the largest |product| of the last row in its last tile: the two-pass amax must see it
    x[-1, d - 1], x[-1, 2 * d - 1] = 50.0, 50.0
    fused, unfused = _silu_both(x, _input_scale(static))
    _assert_same_bits(fused, unfused)
    codes = fused[0].view(torch.uint8)
    if static:
        assert (fused[1] == STATIC_SCALE).all() and ((codes & 0x7F) == MAX_CODE).any()
    else:
        nonzero = silu_and_mul(x).float().abs().amax(dim=1) > 0
        assert ((codes & 0x7F) == MAX_CODE).any(dim=1).tolist() == nonzero.tolist()
        assert codes[-1, d - 1] == MAX_CODE


@pytest.mark.parametrize("static", [False, True])
def test_silu_and_mul_fp8_quant_in_narrower_tiles_writes_the_same_bits(static, monkeypatch):
    """`tile=` (the kernel bench's long-row candidate): 300 columns in tiles of 64, the last of 44, walked
    twice; the amax in the last tile."""
    launches = GridRecorder(silu_and_mul_module._silu_and_mul_fp8_kernel)
    monkeypatch.setattr(silu_and_mul_module, "_silu_and_mul_fp8_kernel", launches)
    x = _rows(3, 600, torch.bfloat16, seed=6)
    x[-1, 299], x[-1, 599] = 50.0, 50.0
    codes, scale = _poisoned(3, 300)
    tiled = silu_and_mul_fp8_quant(x, _input_scale(static), out=codes, scale_out=scale, tile=64)
    # one warp per 256 columns, at least one
    assert [(kwargs["TILE"], kwargs["num_warps"]) for kwargs in launches.constexprs] == [(64, 1)]
    _assert_same_bits(tiled, quantize_fp8(silu_and_mul(x), _input_scale(static)))
    assert static or tiled[0].view(torch.uint8)[-1, 299] == MAX_CODE


def test_silu_and_mul_fp8_quant_refuses_a_bad_tile():
    x = _rows(1, 64, torch.bfloat16, seed=7)
    with pytest.raises(ValueError, match=r"^tile: must be a power of two >= 16, got 48$"):
        silu_and_mul_fp8_quant(x, tile=48)
    with pytest.raises(ValueError, match=r"^tile: per token or static scales only, not with group_size$"):
        silu_and_mul_fp8_quant(x, group_size=16, tile=32)


# NaN and inf inputs on purpose: the interpreter's numpy says so
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_silu_and_mul_fp8_quant_nan_and_inf_as_the_unfused_path(dtype, static):
    d = 150
    x = _rows(4, 2 * d, dtype, seed=5)
    x[0, 3] = float("nan")  # gate NaN
    x[2, d + 5] = float("inf")  # up inf: the product inf (dynamic: scale inf, other codes 0 or NaN)
    x[3, 9] = float("-inf")  # silu(-inf) = -inf / inf: NaN
    fused, unfused = _silu_both(x, _input_scale(static))
    assert torch.equal(fused[0].view(torch.uint8), unfused[0].view(torch.uint8))
    assert torch.equal(fused[1].isnan(), unfused[1].isnan())
    finite = ~unfused[1].isnan()
    assert torch.equal(fused[1][finite], unfused[1][finite])
    assert ((fused[0].view(torch.uint8)[0] & 0x7F) == 0x7F).any()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
# partial last group; groups of 16 in rows of 2 programs; llama-3-8b's 14,336 in 7; one 4096-wide group
@pytest.mark.parametrize(
    ("num_rows", "d", "group_size"), [(1, 300, 128), (67, 2100, 16), (3, 14336, 128), (2, 5000, 4096)]
)
def test_silu_and_mul_fp8_quant_in_groups_is_silu_and_mul_then_quantize_fp8_groups(
    dtype, num_rows, d, group_size
):
    x = _rows(num_rows, 2 * d, dtype, seed=4)
    x[-1, d - 1], x[-1, 2 * d - 1] = 50.0, 50.0  # the last group's amax at its last column
    x[-1, :d].masked_fill_(x[-1, :d].abs() < 2, float("nan"))[0] = 1.0  # ~95% NaN gates: NaN groups too
    codes, scale = _poisoned(num_rows, d, group_size)
    fused = silu_and_mul_fp8_quant(x, out=codes, scale_out=scale, group_size=group_size)
    assert fused[0] is codes and fused[1] is scale
    unfused = quantize_fp8_groups(silu_and_mul(x), group_size)
    assert torch.equal(fused[0].view(torch.uint8), unfused[0].view(torch.uint8))
    assert torch.equal(fused[1].isnan(), unfused[1].isnan())
    finite = ~unfused[1].isnan()
    assert torch.equal(fused[1][finite], unfused[1][finite]) and finite[:-1].all()
    maxima = _group_maxima(fused[0], group_size)  # every group of the rows before the last holds a 448,
    assert maxima[[row for row in range(num_rows - 1) if row != 1]].all()
    assert num_rows < 3 or not maxima[1].any()  # but row 1's, all zeros


# fbgemm_fp8's cap on a row's amax: 1.0 bites on most rows of `_rows` (magnitudes 1e-2 to 10), not the first
CAP = 1.0


def test_rms_norm_fp8_quant_with_a_cap_is_rms_norm_then_capped_quantize_bit_for_bit():
    x, residual = _rows(9, 300, torch.bfloat16, seed=0), _rows(9, 300, torch.bfloat16, seed=1)
    weight = (1.0 + torch.randn(300, generator=torch.Generator().manual_seed(2))).bfloat16().to(DEVICE)
    codes, scale = _poisoned(9, 300)
    fused = rms_norm_fp8_quant(x, weight, EPS, residual, out=codes, scale_out=scale, scale_ub=CAP)
    normed = rms_norm(x, weight, EPS, residual)[0]
    _assert_same_bits(fused[:2], quantize_fp8(normed, scale_ub=CAP))
    capped = fused[1] == torch.tensor(CAP) / 448
    assert capped.any() and not capped.all()  # the norm's rows reach ~4: capped, unless tiny
    assert not torch.equal(fused[1], quantize_fp8(normed)[1])


@pytest.mark.parametrize("d", [300, FP8_MAX_TILE + 300])  # one tile; two passes over two
def test_silu_and_mul_fp8_quant_with_a_cap_is_silu_and_mul_then_capped_quantize_bit_for_bit(d):
    x = _rows(5, 2 * d, torch.bfloat16, seed=4)
    x[3, 0] = float("nan")
    codes, scale = _poisoned(5, d)
    fused = silu_and_mul_fp8_quant(x, out=codes, scale_out=scale, scale_ub=CAP)
    unfused = quantize_fp8(silu_and_mul(x), scale_ub=CAP)
    assert torch.equal(fused[0].view(torch.uint8), unfused[0].view(torch.uint8))
    finite = ~unfused[1].isnan()
    assert torch.equal(fused[1].isnan(), ~finite) and not finite[3] and finite.sum() == 4
    assert torch.equal(fused[1][finite], unfused[1][finite])
    cap_scale = torch.tensor(CAP) / 448
    assert fused[1][4] == cap_scale and fused[1][2] < cap_scale  # magnitudes 10 (capped) and 0.32


def test_strided_rows_and_no_rows():
    x = _rows(4, 2 * 200 + 24, torch.float16, seed=6)[:, :400]
    weight = torch.ones(400, dtype=torch.float16, device=DEVICE)
    _assert_same_bits(_silu_both(x, None)[0], quantize_fp8(silu_and_mul(x)))
    fused, unfused = _rms_norm_both(x, weight, None, None)
    _assert_same_bits(fused[:2], unfused[:2])
    empty = torch.empty(0, 64, device=DEVICE)
    codes, scale, residual_out = rms_norm_fp8_quant(empty, torch.ones(64, device=DEVICE), EPS)
    assert codes.shape == (0, 64) and scale.shape == (0, 1) and residual_out is empty
    codes, scale = silu_and_mul_fp8_quant(empty)
    assert codes.shape == (0, 32) and codes.dtype == FP8 and scale.shape == (0, 1)


def _bad_arguments():
    x = torch.randn(4, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    one = torch.tensor(1.0, device=DEVICE)
    return [
        (
            lambda: rms_norm_fp8_quant(x, weight, EPS, input_scale=0.5),
            r"^input_scale: expected a torch.Tensor",
        ),
        (lambda: rms_norm_fp8_quant(x, weight, EPS, input_scale=one.half()), r"^input_scale: dtype"),
        (lambda: rms_norm_fp8_quant(x, weight[:32], EPS), r"^weight: expected shape \(64,\)"),
        (lambda: rms_norm_fp8_quant(x, weight, EPS, scale_out=one.expand(4)), r"^scale_out: expected 2 dims"),
        (lambda: silu_and_mul_fp8_quant(x[:, :63]), r"^x: last dim must be even"),
        (lambda: silu_and_mul_fp8_quant(x, one.expand(2)), r"^input_scale: expected shape \(\) or \(1,\)"),
        (lambda: silu_and_mul_fp8_quant(x, out=x), r"^out: dtype torch.float32 is not one of"),
        (
            lambda: rms_norm_fp8_quant(x, weight, EPS, input_scale=one, group_size=32),
            r"^input_scale: group scales are dynamic",
        ),
        (lambda: silu_and_mul_fp8_quant(x, group_size=24), r"^group_size: must be a power of two >= 16"),
        (lambda: silu_and_mul_fp8_quant(x, one, scale_ub=1.0), r"^scale_ub: caps per-token scales, not with"),
        (
            lambda: rms_norm_fp8_quant(x, weight, EPS, group_size=32, scale_ub=1.0),
            r"^scale_ub: caps per-token",
        ),
        (lambda: rms_norm_fp8_quant(x, weight, EPS, scale_ub=0.0), r"^scale_ub: must be a positive finite"),
        (
            lambda: rms_norm_fp8_quant(x, weight, EPS, warps=12),
            r"^warps: must be a power of two >= 1, got 12$",
        ),
        (lambda: rms_norm_fp8_quant(x, weight, EPS, warps=64), r"^warps: at most 32, got 64$"),
        (lambda: rms_norm(x, weight, EPS, warps=0), r"^warps: must be a power of two >= 1, got 0$"),
        (
            lambda: rms_norm_fp8_quant(x, weight, EPS, group_size=8),
            r"^group_size: must be a power of two >= 16",
        ),
        (
            lambda: rms_norm_fp8_quant(
                x, weight, EPS, scale_out=torch.empty(4, 1, device=DEVICE), group_size=32
            ),
            r"^scale_out: expected shape \(4, 2\)",
        ),
    ]


@pytest.mark.parametrize("index", range(len(_bad_arguments())))
def test_bad_arguments_raise_naming_the_argument(index):
    call, message = _bad_arguments()[index]
    with pytest.raises(ValueError, match=message):
        call()
