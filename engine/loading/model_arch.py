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
    """Shape, RoPE and special token ids of a Llama-family model; validated on construction."""

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
        _check_architecture(self.architecture)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads: must divide num_attention_heads")

    @property
    def q_size(self) -> int:
        """Width of the query projection: num_attention_heads * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection: num_key_value_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.q_size, self.kv_size
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + h

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str = "unknown") -> ModelArchConfig:
        """Build from a parsed `config.json`. Raises ValueError naming the field when it is unusable."""
        architectures = config.get("architectures") or ["LlamaForCausalLM"]
        architecture = architectures[0]
        _check_architecture(architecture)  # before the shape fields, which another family may lack
        num_heads = _required(config, "num_attention_heads")
        hidden = _required(config, "hidden_size")
        return cls(
            architecture=architecture,
            vocab_size=_required(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(config, "intermediate_size"),
            num_hidden_layers=_required(config, "num_hidden_layers"),
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
            eos_token_ids=token_ids(config.get("eos_token_id")),
            name=name,
        )


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A config's `eos_token_id` (one id, a list of ids, or absent) as a tuple of ids."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _check_architecture(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architectures: {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _required(config: dict[str, Any], key: str) -> Any:
    if key not in config:
        raise ValueError(f"{key}: missing from the model's config.json")
    return config[key]


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
