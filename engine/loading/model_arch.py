"""The shape of a decoder-only model, read from a Hugging Face `config.json` (or built by a loader).

Fields every architecture shares live here; a model file reads its own extras (q/k norms, Gemma's local
rope base, ...) from `extra`, the config.json it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from sluice.engine.loading.config_fields import flag, positive_float, positive_int
from sluice.engine.loading.language_model import language_model_config
from sluice.engine.loading.rope_scaling import RopeScaling, rope_scaling_from_config, rope_theta
from sluice.engine.model_registry import (
    MODEL_TYPE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    TEXT_ONLY_ARCHITECTURES,
)
from sluice.engine.text.tokenizer import token_ids

LAYER_TYPES = ("full_attention", "sliding_attention")
# Their configs window only the layers from `max_window_layers` (transformers' default 28) on.
QWEN_WINDOW_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
QWEN_MAX_WINDOW_LAYERS = 28
# transformers' defaults for keys a config.json leaves out (every family's config class: 1e-6; Gemma 3's
# global RoPE base 1e6; Mistral's, Qwen's and Gemma 3's window 4096).
DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 10000.0
GEMMA3_ROPE_THETA = 1_000_000.0
DEFAULT_SLIDING_WINDOW = 4096
GEMMA3_SLIDING_WINDOW_PATTERN = 6
# Where a config.json leaves the key out (not where it is null: then hidden_size // num_attention_heads and
# num_attention_heads, Llama's rule), each family's config class default.
FAMILY_DEFAULTS: dict[str, dict[str, int]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"num_key_value_heads": 8, "max_position_embeddings": 131072},
    "Qwen2ForCausalLM": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
    # Gemma3TextConfig's: the hub's multimodal Gemma 3 configs leave vocab_size (and the 4B its heads) out.
    "Gemma3ForCausalLM": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
    },
}


@dataclass(frozen=True)
class ModelArchConfig:
    """Shape, RoPE, attention windows and special token ids of a model; validated on construction."""

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
    attention_bias: bool = False  # biases on q, k and v
    o_proj_bias: bool = False
    mlp_bias: bool = False  # on gate, up and down (Llama's mlp_bias)
    sliding_window: int | None = None
    # Per layer, "full_attention" or "sliding_attention"; () means every layer is sliding when
    # sliding_window is set (Mistral), else full.
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "unknown"
    # The multimodal checkpoint's architecture whose language model this is (`language_model`), else None.
    multimodal_architecture: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check_architecture(self.architecture)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads: must divide num_attention_heads")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window: must be > 0, got {self.sliding_window}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types: {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        if any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types: each must be one of {LAYER_TYPES}, got {self.layer_types}")

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None when it attends to its whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer is windowed (then KV blocks wholly before it can be freed);
        None when any layer keeps its full context."""
        windows = {self.layer_sliding_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

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
        """Build from a parsed `config.json`. Raises ValueError naming the field when it is unusable: absent
        where transformers has no default, of the wrong type or out of range."""
        architecture = _architecture(config)
        _check_architecture(architecture)  # before the shape fields, which another family may lack
        if architecture in TEXT_ONLY_ARCHITECTURES:
            text = cls.from_hf_config(language_model_config(config, architecture), name)
            return replace(text, multimodal_architecture=architecture)
        config = {**FAMILY_DEFAULTS.get(architecture, {}), **config}
        if config.get("use_bidirectional_attention"):
            raise ValueError(
                "use_bidirectional_attention: bidirectional attention (an embedding model's) is not "
                "supported; Sluice serves causal decoders"
            )
        num_heads = positive_int(config, "num_attention_heads")
        hidden = positive_int(config, "hidden_size")
        rope_scaling = rope_scaling_from_config(config)
        return cls(
            architecture=architecture,
            vocab_size=positive_int(config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=positive_int(config, "intermediate_size"),
            num_hidden_layers=positive_int(config, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=positive_int(config, "num_key_value_heads", num_heads),
            head_dim=positive_int(config, "head_dim", hidden // num_heads),
            max_position_embeddings=_max_positions(config, rope_scaling),
            rms_norm_eps=positive_float(config, "rms_norm_eps", DEFAULT_RMS_NORM_EPS),
            rope_theta=_rope_theta(architecture, config),
            rope_scaling=rope_scaling,
            # transformers' default: Gemma 3 ties its output projection to the embeddings, the others not.
            tie_word_embeddings=flag(config, "tie_word_embeddings", architecture == "Gemma3ForCausalLM"),
            **_biases(architecture, config),
            **_windows(architecture, config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=token_ids(config.get("eos_token_id")),
            name=name,
            extra=dict(config),
        )


def _architecture(config: dict[str, Any]) -> str:
    """config.json's `architectures[0]`; without one, the architecture of its `model_type`, as transformers'
    Auto classes pick the model."""
    architectures = config.get("architectures")
    if architectures:
        if not isinstance(architectures, list) or not isinstance(architectures[0], str):
            raise ValueError(f"architectures: must be a list of class names, got {architectures!r}")
        return architectures[0]
    model_type = config.get("model_type")
    if model_type in MODEL_TYPE_ARCHITECTURES:
        return MODEL_TYPE_ARCHITECTURES[model_type]
    raise ValueError(
        f"architectures: missing from the model's config.json, and its model_type {model_type!r} is not one "
        f"of the supported {', '.join(MODEL_TYPE_ARCHITECTURES)}"
    )


def _biases(architecture: str, config: dict[str, Any]) -> dict[str, bool]:
    """Which projections have a bias, as transformers builds each family: config.json's attention_bias
    puts one on q, k, v and o (Llama, Qwen3, Gemma 3); Qwen2 has them on q, k and v always and never on
    o; Mistral on none; Llama's mlp_bias on the MLP's three."""
    attention_bias = bool(config.get("attention_bias", False))
    if architecture == "Qwen2ForCausalLM":
        return {"attention_bias": True}
    if architecture == "MistralForCausalLM":
        return {}
    mlp_bias = architecture == "LlamaForCausalLM" and bool(config.get("mlp_bias", False))
    return {"attention_bias": attention_bias, "o_proj_bias": attention_bias, "mlp_bias": mlp_bias}


def _check_architecture(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architectures: {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _max_positions(config: dict[str, Any], rope_scaling: RopeScaling | None) -> int:
    """config.json's max_position_embeddings; with "yarn" at least original_max_position_embeddings * factor,
    the context YaRN extends to (Qwen2.5 and Qwen3 configs keep their pre-YaRN length; vLLM derives its
    max_model_len from the same product)."""
    limit = positive_int(config, "max_position_embeddings", 4096)
    if rope_scaling is None or rope_scaling.rope_type != "yarn":
        return limit
    return max(limit, int(rope_scaling.original_max_position_embeddings * rope_scaling.factor))


def _windows(architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types as transformers builds each family: Mistral windows every layer,
    unless its config has a layer_types (transformers then builds it as Ministral: the layers marked
    sliding); Qwen2/Qwen3 only with `use_sliding_window` (default off), the layers from
    `max_window_layers` on; Gemma 3 the layers its layer_types (or sliding_window_pattern, default 6)
    mark sliding; Llama only the layers a layer_types marks, as vLLM reads it (transformers' Llama
    ignores the key, which configs converted from Mistral or Qwen keep: every layer was windowed)."""
    window = config.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    if architecture == "MistralForCausalLM" and not config.get("layer_types"):
        return {"sliding_window": window}
    if architecture in QWEN_WINDOW_ARCHITECTURES and not config.get("use_sliding_window", False):
        return {}
    if architecture == "Gemma3ForCausalLM":
        config = {"sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN, **config}
    layer_types = _layer_types(architecture, config)
    if "sliding_attention" not in layer_types:
        return {"layer_types": layer_types}
    if window is None:  # transformers fails on it too (a window of None); vLLM would attend in full
        raise ValueError(
            "sliding_window: null, but layer_types has sliding_attention layers: give the window's size "
            "(or mark those layers full_attention)"
        )
    return {"sliding_window": window, "layer_types": layer_types}


def _layer_types(architecture: str, config: dict[str, Any]) -> tuple[str, ...]:
    """config.json's `layer_types`, or the one older configs imply: a `sliding_window_pattern` p (older
    Gemma 3 configs and GGUFs) makes every p-th layer full and the others sliding; Qwen2/Qwen3's
    `use_sliding_window` windows the layers from `max_window_layers` on, as transformers derives it."""
    if config.get("layer_types"):
        return tuple(config["layer_types"])
    layers = range(positive_int(config, "num_hidden_layers"))
    pattern = config.get("sliding_window_pattern")
    if pattern:
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in layers)
    windowed = config.get("use_sliding_window") and config.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    if architecture in QWEN_WINDOW_ARCHITECTURES and windowed:  # a null window: none (transformers')
        first = config.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in layers)
    return ()


def _rope_theta(architecture: str, config: dict[str, Any]) -> float:
    default = GEMMA3_ROPE_THETA if architecture == "Gemma3ForCausalLM" else DEFAULT_ROPE_THETA
    return rope_theta(config, default)
