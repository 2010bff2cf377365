"""Rotary position embedding (RoPE), with the "llama3" frequency scaling of Llama 3.1/3.2, "linear"
position scaling (Gemma 3's global layers), explicit per-frequency factors (a GGUF's rope_freqs), or "yarn"
(Qwen2.5/Qwen3 long context: scaled frequencies, and cos and sin multiplied by an attention factor, which
every implementation reads from the one cos|sin table).

Uses the Hugging Face "rotate half" layout: the first half of each head is paired with the second
half, which is how Hugging Face checkpoints store q_proj/k_proj.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

import torch

from sluice.engine.loading.model_arch import RopeScaling
from sluice.engine.worker.layers.custom_op import CustomOp
from sluice.engine.worker.layers.kernel_config import KernelConfig
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
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    return _llama3_scale(inv_freq, scaling)


def attention_scaling(scaling: RopeScaling | None) -> float:
    """The factor cos and sin are multiplied by: 1 but for "yarn", where it mirrors transformers'
    `_compute_yarn_parameters`: `attention_factor` when set; else m(mscale) / m(mscale_all_dim) when both are
    set, else m(1), where m(s) = 0.1 * s * ln(factor) + 1 (1 when factor <= 1)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        factor = scaling.factor
        return _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Mirrors transformers' `_compute_yarn_parameters` (NTK-by-parts): dimension i keeps its frequency
    (extrapolation) below `low`, is divided by `factor` (interpolation) above `high`, and mixes the two
    linearly between, where low and high are the dimensions that turn `beta_fast` and `beta_slow` times over
    the original context."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float32) / head_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (scaling.factor * pos_freqs)
    low, high = _yarn_correction_range(head_dim, theta, scaling)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation


def _yarn_correction_range(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[float, float]:
    """The dimensions whose frequencies turn `beta_fast` and `beta_slow` times over the original context,
    widened to whole dimensions when `truncate`, within [0, head_dim - 1]."""

    def dimension(num_rotations: float) -> float:
        turns = scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return (head_dim * math.log(turns)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


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
    """[max_position, head_dim] fp32: cos of the head_dim // 2 frequencies, then their sin, both times the
    scaling's `attention_scaling` (YaRN's), as transformers multiplies them in fp32. Every implementation
    rotates from this table (the Triton and C++ kernels, the native path's model-dtype copy, the C++ decoder
    stack), so none applies the factor itself."""
    # On `device`, as transformers computes its tables: CUDA's cos/sin may differ from the CPU's by an ulp.
    inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling).to(device)
    freqs = torch.arange(max_position, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    scale = attention_scaling(rope_scaling)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat([cos, sin], dim=-1)


# rope(q, k) -> (q, k): one step's rotation, applied by every layer.
Rope = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TritonRope:
    """The Triton kernel's rotation for one step, a `Rope` like the others. It keeps what the kernel reads,
    so that an attention backend that also stores K/V in that kernel (`rotate_and_store`) can take the
    rotation over: `sluice.engine.worker.layers.attention.Attention.forward`."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernel(self.positions, q, k, self.cos_sin_cache)


class RotaryEmbedding(CustomOp):
    """Rotates q and k by their positions: `rope = rotary(positions)` once per step, then `q, k = rope(q, k)`
    in every layer. `select` builds the tables, on the model's device.

        triton  the fused kernel `sluice.kernels.rotary.rotary_embedding` rotates q and k in place from the
                fp32 cos|sin table `cos_sin_cache`, one program per token, one rounding (a CUDA graph can
                capture it)
        cpu     the C++ kernel `sluice.kernels.cpu_rotary`, in place from the same table
        native  cos/sin tables [max_positions, head_dim] in the model dtype (each half repeated), applied
                out of place with the model-dtype roundings of transformers' `apply_rotary_pos_emb`
    """

    implementations = ("triton", "cpu", "native")
    cpu_kernel = CPU_ROTARY

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling

    def select(self, kernels: KernelConfig) -> None:
        super().select(kernels)
        if kernels.device.type == "meta":
            # A model built only for its parameters' shapes rotates nothing; tables on meta would run
            # torch's Python decompositions, whose first call imports torch._dynamo (~2 s a process).
            return
        self.cos_sin_cache = build_cos_sin_cache(
            self.head_dim, self.max_positions, self.theta, self.scaling, kernels.device
        )
        if self.implementation == "triton":  # imported only when chosen: triton is not installed everywhere
            self._triton_rotary = import_module("sluice.kernels.rotary").rotary_embedding
        elif self.implementation == "native":
            cos, sin = self.cos_sin_cache.chunk(2, dim=-1)
            self.cos = torch.cat((cos, cos), dim=-1).to(kernels.dtype)
            self.sin = torch.cat((sin, sin), dim=-1).to(kernels.dtype)

    # Each takes positions [T] and returns the rotation for them, gathered once for all layers. It takes
    # q: [T, num_heads, head_dim] and k: [T, num_kv_heads, head_dim] (may be views of the fused qkv
    # projection; the Triton and C++ kernels write into them).

    def forward_triton(self, positions: torch.Tensor) -> Rope:
        return TritonRope(positions, self.cos_sin_cache, self._triton_rotary)

    def forward_cpu(self, positions: torch.Tensor) -> Rope:
        return lambda q, k: cpu_rotary_embedding_prechecked(positions, q, k, self.cos_sin_cache)

    def forward_native(self, positions: torch.Tensor) -> Rope:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return lambda q, k: (q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
