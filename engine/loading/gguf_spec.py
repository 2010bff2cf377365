"""How one architecture's GGUF files map onto its Hugging Face names and config: declared by each model
class (`gguf = GGUFSpec(...)`) and read by `sluice.engine.loading.gguf_loader`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N."), Llama layout.
LLAMA_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFSpec:
    """layer_names: llama.cpp layer tensor part -> Hugging Face part (Llama's by default).
    config_keys: `<arch>.<key>` metadata -> config.json key, beyond the shape keys every GGUF has.
    config_defaults: config.json entries the file cannot state (llama.cpp hard-codes them per arch).
    permute_qk: llama.cpp's converter interleaved q/k rotary rows (Llama); NeoX-rope models keep them.
    norm_shift: subtracted from every norm weight (Gemma's converter stores 1 + weight)."""

    layer_names: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_LAYER_NAMES))
    config_keys: Mapping[str, str] = field(default_factory=dict)
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    permute_qk: bool = False
    norm_shift: float = 0.0
