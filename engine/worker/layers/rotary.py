"""Rotary position embedding (RoPE), with the "llama3" frequency scaling of Llama 3.1/3.2 and "linear"
position scaling (Gemma 3's global layers), or explicit per-frequency factors (a GGUF's rope_freqs).

Uses the Hugging Face "rotate half" layout: the first half of each head is paired with the second
half, which is how Hugging Face checkpoints store q_proj/k_proj.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from importlib import import_module

import torch

from sluice.engine.loading.model_arch import RopeScaling
from sluice.kernels.cpu_extension import cpu_extension_available
from sluice.kernels.cpu_rotary import EXTENSION as CPU_ROTARY
from sluice.kernels.cpu_rotary import cpu_rotary_embedding_prechecked


def compute_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "freq_factors":
        if len(scaling.freq_factors) != len(inv_freq):
            raise ValueError(
                f"rope_scaling: {len(scaling.freq_factors)} freq_factors for {len(inv_freq)} frequencies"
            )
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Mirrors transformers' `_compute_llama3_parameters`.

    Long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the band between
    `high_freq_wavelen` and `low_freq_wavelen` is interpolated smoothly.
    """
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    rope_theta: float,
    rope_scaling: RopeScaling | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[max_position, head_dim] fp32: cos of the head_dim // 2 frequencies, then their sin (the table
    `sluice.kernels.rotary.rotary_embedding` reads)."""
    # On `device`, as transformers computes its tables: CUDA's cos/sin may differ from the CPU's by an ulp.
    inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling).to(device)
    freqs = torch.arange(max_position, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


# rope(q, k) -> (q, k): one step's rotation, applied by every layer.
Rope = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class RotaryEmbedding:
    """Rotates q and k by their positions: `rope = rotary.bind(positions)` once per step, then
    `q, k = rope(q, k)` in every layer.

    torch (default): cos/sin tables [max_positions, head_dim] in the model dtype (each half repeated),
        applied out of place with the model-dtype roundings of transformers' `apply_rotary_pos_emb`.
    use_triton: the fused kernel `sluice.kernels.rotary.rotary_embedding` rotates q and k in place from an
        fp32 cos|sin table, one program per token, one rounding (a CUDA graph can capture it).
    float32 on CPU: the C++ kernel `sluice.kernels.cpu_rotary`, in place from the same table.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        dtype: torch.dtype,
        device: torch.device,
        use_triton: bool = False,
    ) -> None:
        self.use_triton = use_triton
        cos_sin = build_cos_sin_cache(head_dim, max_positions, theta, scaling, device)
        self.cos_sin_cache = cos_sin
        if use_triton:
            # Imported only when used: triton is not installed everywhere the torch path runs.
            self._fused = import_module("sluice.kernels.rotary").rotary_embedding
            return
        self._fused = None
        on_cpu = torch.device(device).type == "cpu"
        if dtype == torch.float32 and on_cpu and cpu_extension_available(CPU_ROTARY):
            self._fused = cpu_rotary_embedding_prechecked
            return
        cos, sin = cos_sin.chunk(2, dim=-1)
        self.cos = torch.cat((cos, cos), dim=-1).to(dtype)
        self.sin = torch.cat((sin, sin), dim=-1).to(dtype)

    @property
    def runs_cpu_kernel(self) -> bool:
        """Whether the C++ kernel rotates q and k, from `cos_sin_cache`."""
        return self._fused is cpu_rotary_embedding_prechecked

    def bind(self, positions: torch.Tensor) -> Rope:
        """The rotation for positions [T], gathered once for all layers. It takes q: [T, num_heads,
        head_dim] and k: [T, num_kv_heads, head_dim] (may be views of the fused qkv projection; the
        Triton and C++ paths write into them)."""
        if self._fused is not None:
            return lambda q, k: self._fused(positions, q, k, self.cos_sin_cache)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return lambda q, k: (q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
