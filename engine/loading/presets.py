"""Shapes for random-weight ("dummy") models, written as the `config.json` fields of the real ones.

"tiny" is a 31M-parameter Llama with a 32000 vocab, small enough to run on a laptop CPU; the others copy
the published configs so memory and speed can be measured without downloading weights.
"""

from __future__ import annotations

from typing import Any

from sluice.engine.loading.model_arch import ModelArchConfig

_LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE_SCALING,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-2-7b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mistral-7b": {  # Mistral-7B-v0.1
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    "qwen2-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
}


def preset_arch(name: str) -> ModelArchConfig:
    """The shape of preset `name`. Raises ValueError naming the known presets when it is not one."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}; known: {', '.join(PRESETS)}")
    return ModelArchConfig.from_hf_config(PRESETS[name], name=name)
