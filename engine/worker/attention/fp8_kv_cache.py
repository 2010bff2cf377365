"""An FP8 (e4m3) KV cache (`--kv-cache-dtype fp8`): a byte per value, so twice the tokens of a bf16 cache.

    stored   k_cache[slot] = e4m3(clamp(k / k_scale, -448, 448))      (v likewise with v_scale)
    read     k = float32(k_cache[slot]) * k_scale, in the model dtype

k_scale and v_scale are float32 scalars, one pair per attention layer: the checkpoint's
`self_attn.k_scale` / `v_scale` (compressed-tensors' kv_cache_scheme), else 1.0. Every read sees the
rounded values, this step's tokens included (a prefill attends its own K/V as the cache holds them), so a
prompt computed in one step, in chunks, or read from the prefix cache attends the same numbers.

The torch backend dequantizes what it gathers; the C++ CPU kernel reads the model dtype, so its backend
dequantizes the blocks a step's block tables name into a scratch cache first (`dequantize_blocks`): a
correctness path. The Triton kernels do both in registers (`sluice.kernels.store_kv.quantize_e4m3`, bit for
bit `quantize_kv`; `sluice.kernels.paged_attention_tile`: by default the codes' own values in the dots with
the scales folded into the scores and the output, else `dequantize_e4m3`, `dequantize_kv`'s values), reading
the scales on the device, so CUDA graphs capture them. flash-attn 2 does not read e4m3: the selector refuses
it with an FP8 cache, and "auto" takes triton.
"""

from __future__ import annotations

import torch

from sluice.kernels.tensor_checks import FP8_KV_DTYPE as FP8
from sluice.kernels.tensor_checks import KVScales  # (k_scale, v_scale), float32 scalars

FP8_MAX = torch.finfo(FP8).max  # 448


def backend_kv_cache_dtype(kv_cache_dtype: torch.dtype | None) -> torch.dtype | None:
    """A backend's `kv_cache_dtype` argument, checked: None (the model dtype) or FP8; ValueError naming the
    field otherwise. (The kernels' check of the caches themselves: `sluice.kernels.tensor_checks`.)"""
    if kv_cache_dtype not in (None, FP8):
        raise ValueError(f"kv_cache_dtype: None or {FP8}, got {kv_cache_dtype}")
    return kv_cache_dtype


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any shape, float) -> e4m3 codes of x / scale, saturated at +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 codes -> codes * scale, computed in float32, in `dtype`."""
    return (codes.float() * scale).to(dtype)


def store_fp8_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize k, v [num_tokens, num_kv_heads, head_dim] into the e4m3 caches [num_blocks, block_size,
    num_kv_heads, head_dim] (any strides) at slot_mapping [num_tokens] (slots >= 0). Returns k, v as the
    cache now holds them, in their dtype."""
    k_scale, v_scale = kv_scales
    k_codes, v_codes = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = k_codes
    v_cache[blocks, offsets] = v_codes
    return dequantize_kv(k_codes, k_scale, k.dtype), dequantize_kv(v_codes, v_scale, v.dtype)


def dequantize_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_scales: KVScales,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks `block_tables` [num_seqs, max_blocks] names, dequantized into new caches [num_used,
    block_size, num_kv_heads, head_dim] in `dtype`, and the tables renumbered into them (int32):

        block_tables [[7, 2, 9], [2, 4, 0]] -> used blocks [0, 2, 4, 7, 9] -> [[3, 1, 4], [1, 2, 0]]

    Padding and freed-window entries (block 0, a real block) are dequantized too: masked, never attended.
    """
    used = torch.unique(block_tables.long())  # sorted
    tables = torch.searchsorted(used, block_tables.long()).to(torch.int32)
    k_scale, v_scale = kv_scales
    return dequantize_kv(k_cache[used], k_scale, dtype), dequantize_kv(v_cache[used], v_scale, dtype), tables
