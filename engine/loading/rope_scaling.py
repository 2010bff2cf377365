"""A model's RoPE scaling (`RopeScaling`), read from the `rope_scaling` / `rope_parameters` of a Hugging Face
`config.json` (or of the config a GGUF loader builds) as transformers reads it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluice.engine.loading.config_fields import positive_float, positive_int

ROPE_SCALING_TYPES = ("llama3", "linear", "freq_factors", "yarn")
PREFIX = "rope_scaling."  # before a field's name in messages (transformers >= 5 writes rope_parameters)


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of type "llama3" (Llama 3.1/3.2), "linear" (positions divided by `factor`, e.g.
    Gemma 3's global layers), "freq_factors" (each inverse frequency divided by its factor, as a GGUF's
    `rope_freqs.weight` stores the llama3 scaling) or "yarn" (Qwen2.5/Qwen3 long context: frequencies that
    turn fewer than `beta_slow` times over `original_max_position_embeddings` divided by `factor`, those
    that turn more than `beta_fast` times kept, a ramp between; cos and sin multiplied by an attention
    factor, `attention_factor` or one derived from `factor`, `mscale` and `mscale_all_dim`); None on the
    config means plain RoPE."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    freq_factors: tuple[float, ...] = ()
    # "yarn" only; the defaults are transformers'.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(_unsupported(self.rope_type))
        if self.rope_type != "yarn":
            return
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor: must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings: must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ValueError(f"rope_scaling.attention_factor: must be > 0, got {self.attention_factor}")


def _unsupported(kind: Any) -> str:
    return (
        f"rope_scaling: type {kind!r} is not supported; "
        f"supported: {', '.join(repr(t) for t in ROPE_SCALING_TYPES)}"
    )


def rope_parameters(config: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """The RoPE settings of `layer_type` layers. transformers >= 5 writes `rope_parameters` (per layer
    type for hybrid models such as Gemma 3); older configs write `rope_theta` and `rope_scaling`. A config
    with both is read as transformers reads it: a `rope_scaling` replaces the global layers'
    rope_parameters whole (their rope_theta too: `rope_theta` below), or, in a per-layer-type one (Gemma
    3's config class), is merged into its full_attention settings."""
    params = config.get("rope_parameters") or {}
    nested = layer_type in params or "full_attention" in params
    if nested:
        params = params.get(layer_type) or {}
    if layer_type != "full_attention":
        return params  # an older config's rope_scaling is its global layers' (Gemma 3: local RoPE plain)
    scaling = config.get("rope_scaling") or {}
    return {**params, **scaling} if nested else dict(scaling or params)


def rope_theta(config: dict[str, Any], default: float) -> float:
    """The global layers' RoPE base, in transformers' order: the RoPE settings' own (`rope_parameters`),
    then a top-level `rope_theta`, then the family's default."""
    return float(rope_parameters(config).get("rope_theta") or config.get("rope_theta") or default)


def rope_scaling_from_config(
    config: dict[str, Any], layer_type: str = "full_attention"
) -> RopeScaling | None:
    """The `RopeScaling` of a parsed `config.json`'s `layer_type` layers; None for plain RoPE. Raises
    ValueError naming rope_scaling and the type when the type is not supported (dynamic, longrope, ...)."""
    scaling = rope_parameters(config, layer_type)
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind not in _PARSERS:
        raise ValueError(_unsupported(kind))
    return _PARSERS[kind](scaling, config)


def _linear(scaling: dict[str, Any], config: dict[str, Any]) -> RopeScaling:
    return RopeScaling(factor=positive_float(scaling, "factor", prefix=PREFIX), rope_type="linear")


def _freq_factors(scaling: dict[str, Any], config: dict[str, Any]) -> RopeScaling:
    factors = tuple(float(f) for f in scaling["freq_factors"])
    return RopeScaling(factor=1.0, rope_type="freq_factors", freq_factors=factors)


def _llama3(scaling: dict[str, Any], config: dict[str, Any]) -> RopeScaling:
    original = positive_int(scaling, "original_max_position_embeddings", prefix=PREFIX)
    return RopeScaling(
        factor=positive_float(scaling, "factor", prefix=PREFIX),
        low_freq_factor=positive_float(scaling, "low_freq_factor", prefix=PREFIX),
        high_freq_factor=positive_float(scaling, "high_freq_factor", prefix=PREFIX),
        original_max_position_embeddings=original,
    )


def _yarn(scaling: dict[str, Any], config: dict[str, Any]) -> RopeScaling:
    """As transformers reads it: a top-level `original_max_position_embeddings` first, then the scaling's,
    then `max_position_embeddings`; without `factor`, max_position_embeddings over the original; a beta or
    mscale of 0 counts as absent."""
    max_positions = config.get("max_position_embeddings", 4096)
    original = (
        config.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings")
        or max_positions
    )
    factor = scaling.get("factor")
    attention_factor = scaling.get("attention_factor")
    return RopeScaling(
        factor=float(factor if factor is not None else max_positions / original),
        original_max_position_embeddings=int(original),
        rope_type="yarn",
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=float(scaling["mscale"]) if scaling.get("mscale") else None,
        mscale_all_dim=float(scaling["mscale_all_dim"]) if scaling.get("mscale_all_dim") else None,
        attention_factor=float(attention_factor) if attention_factor is not None else None,
        truncate=bool(scaling.get("truncate", True)),
    )


_PARSERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], RopeScaling]] = {
    "linear": _linear,
    "freq_factors": _freq_factors,
    "llama3": _llama3,
    "yarn": _yarn,
}
