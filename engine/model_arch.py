"""The shape of a Llama-family model, read from a Hugging Face `config.json` (or built by a loader)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of type "llama3" (Llama 3.1/3.2); None on the config means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "unknown"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architectures: {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads: must divide num_attention_heads")

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + h

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str = "unknown") -> ModelArchConfig:
        """Build from a parsed `config.json`. Raises ValueError naming the field when it is unusable."""
        architectures = config.get("architectures") or ["LlamaForCausalLM"]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architectures: {architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(config),
            rope_scaling=_rope_scaling(config),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=architecture == "Qwen2ForCausalLM" or config.get("attention_bias", False),
            sliding_window=config.get("sliding_window") if config.get("use_sliding_window", True) else None,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )


def _rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    return float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(config: dict[str, Any]) -> RopeScaling | None:
    # transformers >= 5 writes `rope_parameters`; older configs write `rope_scaling`.
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling: type {kind!r} is not supported; supported: 'llama3'")
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )
