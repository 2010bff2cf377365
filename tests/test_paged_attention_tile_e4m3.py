"""The attention kernels' FP8-KV reads on every e4m3 code, in each way of turning codes into floats
(`E4M3_UPCAST`: the GPU's conversion, as the interpreter runs it with its NaN put back; the integer bit
moves of GPUs without e4m3; the bare conversion on the non-NaN codes: the interpreter reads the NaN
codes 0x7F / 0xFF as +-480, a GPU's cvt gives NaN). `dequantize_e4m3` (FOLD_KV_SCALES = False): bit
for bit torch's `(code.view(float8_e4m3fn).float() * scale).to(dtype)` (`fp8_kv_cache.dequantize_kv`).
`upcast_e4m3` (FOLD_KV_SCALES = True): bit for bit `code.view(float8_e4m3fn).to(dtype)`, in every dtype
(no rounding, so the interpreter's bfloat16 truncation does not matter)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from paged_batch import DEVICE, KERNEL_DTYPES, nan_like

from sluice.engine.worker.attention.fp8_kv_cache import dequantize_kv
from sluice.kernels.paged_attention_tile import (
    E4M3_BITS,
    E4M3_CVT,
    E4M3_CVT_INTERPRETED,
    dequantize_e4m3,
    e4m3_upcast,
    upcast_e4m3,
)
from sluice.kernels.store_kv import gpu_e4m3

# 1.0: the codes themselves; 0.02 and 3.0: the test_triton_fp8_kv scales; 300.0: past fp16's 65504 for the
# largest codes (inf there, one rounding); 1e-5: fp16 and bf16 subnormals and zeros from the small codes.
SCALES = [1.0, 0.02, 3.0, 300.0, 1e-5]
NAN_CODES = torch.tensor([0x7F, 0xFF])
# The interpreter rounds fp32 -> bfloat16 by truncation (numpy has no bfloat16), in either upcast: bf16 is
# checked on a GPU; the fp32 values both round from are checked here.
DTYPES = KERNEL_DTYPES if DEVICE.type == "cuda" else tuple(d for d in KERNEL_DTYPES if d != torch.bfloat16)


@triton.jit
def _dequantize_kernel(codes_ptr, scale_ptr, out_ptr, KV_DTYPE: tl.constexpr, E4M3_UPCAST: tl.constexpr):
    offsets = tl.arange(0, 256)
    values = dequantize_e4m3(tl.load(codes_ptr + offsets), tl.load(scale_ptr), KV_DTYPE, E4M3_UPCAST)
    tl.store(out_ptr + offsets, values)


@triton.jit
def _upcast_kernel(codes_ptr, out_ptr, DTYPE: tl.constexpr, E4M3_UPCAST: tl.constexpr):
    offsets = tl.arange(0, 256)
    tl.store(out_ptr + offsets, upcast_e4m3(tl.load(codes_ptr + offsets), DTYPE, E4M3_UPCAST))


_TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _dequantize(upcast: str, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel's values, torch's values) of all 256 codes."""
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    scale_tensor = torch.tensor(scale, device=DEVICE)
    out = nan_like(torch.empty(256, dtype=dtype, device=DEVICE))
    _dequantize_kernel[(1,)](codes, scale_tensor, out, KV_DTYPE=_TRITON_DTYPES[dtype], E4M3_UPCAST=upcast)
    expected = dequantize_kv(codes.view(torch.float8_e4m3fn), scale_tensor, dtype)
    return out.cpu(), expected.cpu()


def _assert_same_bits(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits where torch's value is a number (zeros' signs, subnormals, infinities included), NaN
    exactly where torch's is NaN."""
    torch.testing.assert_close(got.isnan(), expected.isnan(), rtol=0, atol=0)
    numbers = ~expected.isnan()
    int_type = {4: torch.int32, 2: torch.int16}[got.element_size()]
    assert torch.equal(got[numbers].view(int_type), expected[numbers].view(int_type))


# 448 x 300 is past float16's range: inf, as torch makes it; the interpreter's numpy says so
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize(
    "upcast", [E4M3_CVT_INTERPRETED, E4M3_BITS] if DEVICE.type == "cpu" else [E4M3_CVT, E4M3_BITS]
)
def test_every_code_dequantizes_to_torchs_value(upcast, scale, dtype):
    got, expected = _dequantize(upcast, scale, dtype)
    assert expected.isnan().sum() == 2 and expected[NAN_CODES].isnan().all()
    _assert_same_bits(got, expected)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter's conversion; a GPU runs E4M3_CVT above")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_interpreters_conversion_is_exact_but_for_nan(dtype):
    """Why E4M3_CVT_INTERPRETED exists: the bare conversion matches on the 254 number codes only."""
    got, expected = _dequantize(E4M3_CVT, 3.0, dtype)
    numbers = torch.ones(256, dtype=torch.bool)
    numbers[NAN_CODES] = False
    _assert_same_bits(got[numbers], expected[numbers])
    assert not got[NAN_CODES].isnan().any()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    "upcast", [E4M3_CVT_INTERPRETED, E4M3_BITS] if DEVICE.type == "cpu" else [E4M3_CVT, E4M3_BITS]
)
def test_every_code_upcasts_exactly_to_its_value(upcast, dtype):
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = nan_like(torch.empty(256, dtype=dtype, device=DEVICE))
    _upcast_kernel[(1,)](codes, out, DTYPE=_TRITON_DTYPES[dtype], E4M3_UPCAST=upcast)
    expected = codes.view(torch.float8_e4m3fn).to(dtype)
    assert expected.isnan().sum() == 2 and expected[NAN_CODES].isnan().all()
    assert expected.nan_to_num().abs().max() == 448  # the largest codes and the subnormals:
    assert torch.equal(expected[1:8].cpu().float(), torch.arange(1, 8) / 512)
    _assert_same_bits(out.cpu(), expected.cpu())


def test_the_launchers_pick_the_conversion_the_tests_run():
    assert e4m3_upcast(DEVICE) == (E4M3_CVT_INTERPRETED if DEVICE.type == "cpu" else E4M3_CVT)
    # Quantizing: the integer code in the interpreter (its fp8 casts do not round to nearest even), the
    # GPU's conversion on one with e4m3, which the kernel tests then check against torch's codes.
    assert gpu_e4m3(DEVICE) == (DEVICE.type == "cuda")


def test_ahead_of_time_compiles_off_a_gpu_take_the_gpus_conversions(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert gpu_e4m3(torch.device("cpu")) and e4m3_upcast(torch.device("cpu")) == E4M3_CVT
