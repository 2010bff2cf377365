"""Write one step's K/V into the paged cache at `slot_mapping`.

slot = block_id * block_size + offset          (slot < 0: padding row, skipped)
k_cache[slot // block_size, slot % block_size] = k[t]      for every token t

An FP8 cache (float8_e4m3fn, `--kv-cache-dtype fp8`) gets e4m3 codes instead, made in registers by
`quantize_e4m3`: k_cache[...] = e4m3(clamp(k[t] / k_scale, -448, 448)) (v likewise with v_scale), bit for
bit torch's cast (`sluice.engine.worker.attention.fp8_kv_cache.quantize_kv`). The kernels see the cache as
uint8. On a GPU with e4m3 (compute capability 8.9+, `gpu_e4m3`) the codes come from its own conversion
(`cvt.rn.satfinite.e4m3x2.f32`: nearest even, saturated at +-448, NaN kept); elsewhere (older GPUs, where
Triton refuses its fp8 type, and the interpreter, whose fp8 casts do not round to nearest even) from
integer arithmetic that gives the same bits (`HW_E4M3`, a constexpr of every kernel that quantizes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels.compile_target import compiles_for_capability
from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.tensor_checks import FP8_KV_DTYPE, KVScales, check_store_kv_args

E4M3_MAX = 448.0


def gpu_e4m3(device: torch.device) -> bool:
    """Whether launches on `device` compile for a GPU with e4m3 conversions (compute capability 8.9+,
    `compiles_for_capability`: also off a GPU outside the interpreter, for the ahead-of-time compiles).
    False under TRITON_INTERPRET=1 and on older GPUs. The launchers' HW_E4M3 (`quantize_e4m3`), and
    `paged_attention_tile.e4m3_upcast`'s choice."""
    return compiles_for_capability(device, (8, 9))


@triton.jit
def quantize_e4m3(x, scale, HW_E4M3: tl.constexpr):
    """x (a float tile) -> its e4m3 codes (uint8) of x / scale: saturated at +-448, rounded to nearest
    even, NaN kept. `scale` is an fp32 scalar; the division is IEEE-exact (div_rn). HW_E4M3 (`gpu_e4m3`):
    the GPU's conversion (about a fifth fewer instructions in the quantizing kernels' sm_90 code, which a
    one-row step runs on one SM per row); else integer arithmetic, the same codes (a NaN's sign aside):

        |y| >= 2^-6 (normal):  the fp32 bits rounded to 3 mantissa bits, exponent rebiased 127 -> 7
        |y| <  2^-6 (subnormal): |y| * 2^9 rounded to an integer (adding 2^23 rounds it in fp32)
    """
    y = tl.math.div_rn(x.to(tl.float32), scale)
    if HW_E4M3:  # cvt.rn.satfinite: out-of-range and infinite values saturate, as the clamp below does
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    magnitude = tl.minimum(tl.abs(y), 448.0)  # E4M3_MAX
    bits = magnitude.to(tl.int32, bitcast=True)
    # Round to nearest even on the 20 dropped mantissa bits; a carry moves into the exponent as it should.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = (magnitude * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(bits >= 0x3C800000, normal, subnormal)  # 0x3C800000: 2^-6
    code = tl.where(y != y, 0x7F, code) | sign
    return code.to(tl.uint8)


@triton.jit
def load_store_scales(k_scale_ptr, v_scale_ptr, FP8_KV: tl.constexpr):
    """(k_scale, v_scale) of an FP8 cache, read once per program; (1.0, 1.0), unread and unused, on the
    model-dtype path (the pointers are None there)."""
    k_scale = 1.0
    v_scale = 1.0
    if FP8_KV:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    return k_scale, v_scale


@triton.jit
def to_cache(x, scale, FP8_KV: tl.constexpr, HW_E4M3: tl.constexpr):
    """x as the cache holds it: x itself, or its e4m3 codes of x / scale (FP8_KV)."""
    if FP8_KV:
        x = quantize_e4m3(x, scale, HW_E4M3)
    return x


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,  # FP8_KV only: [] fp32
    v_scale_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    FP8_KV: tl.constexpr,
    HW_E4M3: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One program per token; it moves all [num_kv_heads, head_dim] values of that token.
    token = tl.program_id(0)
    wait_prior_kernel(PDL)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    k_scale, v_scale = load_store_scales(k_scale_ptr, v_scale_ptr, FP8_KV)
    k, v = to_cache(k, k_scale, FP8_KV, HW_E4M3), to_cache(v, v_scale, FP8_KV, HW_E4M3)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(k_dst + heads[:, None] * stride_kc_head + dims[None, :], k, mask=mask)
    tl.store(v_dst + heads[:, None] * stride_vc_head + dims[None, :], v, mask=mask)


def kernel_kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: KVScales | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(k_cache, v_cache, k_scale, v_scale) as the kernels take them: an FP8 cache viewed as its uint8
    codes with its scales, a float cache as it is with None (the kernels' FP8_KV = False path)."""
    if k_cache.dtype != FP8_KV_DTYPE:
        return k_cache, v_cache, None, None
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), kv_scales[0], kv_scales[1]


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into k_cache, v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping [num_tokens] int64 (in place).
    An FP8 cache takes kv_scales (k_scale, v_scale), float32 one-element tensors, and gets e4m3 codes."""
    check_store_kv_args(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k_cache, v_cache, k_scale, v_scale = kernel_kv_cache(k_cache, v_cache, kv_scales)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        FP8_KV=k_scale is not None,
        HW_E4M3=k_scale is not None and gpu_e4m3(k.device),
        **pdl_launch_options(k.device),
    )


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    """Plain PyTorch version of `store_kv` (same arguments, same in-place effect)."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    if kv_scales is None:
        k_cache[blocks, offsets] = k[valid]
        v_cache[blocks, offsets] = v[valid]
        return
    k_scale, v_scale = kv_scales
    k_cache[blocks, offsets] = quantize_e4m3_reference(k[valid], k_scale)
    v_cache[blocks, offsets] = quantize_e4m3_reference(v[valid], v_scale)


def quantize_e4m3_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's e4m3 codes of x / scale saturated at +-448 (what `quantize_e4m3` must equal bit for bit)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_KV_DTYPE)
