"""Write a tiny Hugging Face Llama, Qwen2, Qwen3 or Gemma 3 checkpoint (see checkpoints.py) as a GGUF the way
llama.cpp's `convert_hf_to_gguf.py` does: F32 tensors, Llama's q/k rows (weights and biases) permuted,
Gemma's norms stored as 1 + weight, the byte-level BPE vocabulary, for a "llama3" rope_scaling a
`rope_freqs.weight` tensor of per-frequency divisors (Llama 3.1+ files), and a linear, yarn or other scaling
as `<arch>.rope.scaling.*` metadata."""

from __future__ import annotations

import json
import math
import os

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType
from safetensors.numpy import load_file

_LAYER_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
_PARTS = {
    "llama": {**_LAYER_PARTS, "post_attention_layernorm": "ffn_norm"},
    "qwen2": {**_LAYER_PARTS, "post_attention_layernorm": "ffn_norm"},
    "qwen3": {**_LAYER_PARTS, "post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        **_LAYER_PARTS,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
# `<arch>.rope.scaling.<key>` float32 metadata beyond type, factor and original_context_length.
_FLOAT_ROPE_SCALING_KEYS = (
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_attn_factor",
    "yarn_log_multiplier",
    "yarn_ext_factor",
    "attn_factor",
)
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def llama3_rope_factors(config: dict) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, in effect (float64, then f32)."""
    rope = config.get("rope_scaling") or config["rope_parameters"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = rope.get("rope_theta") or config.get("rope_theta")
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, in effect.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(
    hf_dir: str,
    path: str,
    gguf_arch: str = "llama",
    rope_scaling: dict | None = None,
    leave_out: tuple[str, ...] = (),
) -> str:
    """The checkpoint in `hf_dir` as llama.cpp writes a `gguf_arch` (llama, qwen2, qwen3, gemma3) GGUF;
    rope_scaling {"type", "factor"[, "original_context_length", yarn's "yarn_beta_fast", ...]} becomes
    `<arch>.rope.scaling.*` (`write_shape_metadata`); tensors whose names end with one of `leave_out` are
    not written."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    writer = GGUFWriter(path, gguf_arch)
    writer.add_name(f"tiny {gguf_arch}")
    write_shape_metadata(writer, config, rope_scaling)
    _write_vocabulary(writer, hf_dir, config)
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor(
            "rope_freqs.weight", llama3_rope_factors(config), raw_dtype=GGMLQuantizationType.F32
        )
    for name, value in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if leave_out and name.endswith(leave_out):
            continue
        writer.add_tensor(*_gguf_tensor(name, value, gguf_arch, config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_shape_metadata(writer: GGUFWriter, config: dict, rope_scaling: dict | None) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta") or config.get("rope_theta"))
    if config.get("sliding_window") is not None:  # Qwen2/Qwen3 write null when not windowed
        writer.add_sliding_window(config["sliding_window"])
    if rope_scaling is not None:
        writer.add_rope_scaling_type(RopeScalingType(rope_scaling["type"]))
        writer.add_rope_scaling_factor(rope_scaling["factor"])
        if "original_context_length" in rope_scaling:
            writer.add_rope_scaling_orig_ctx_len(rope_scaling["original_context_length"])
        for key in _FLOAT_ROPE_SCALING_KEYS:  # llama.cpp's yarn keys, written as gguf-py's writer does
            if key in rope_scaling:
                writer.add_float32(f"{writer.arch}.rope.scaling.{key}", rope_scaling[key])


def _write_vocabulary(writer: GGUFWriter, hf_dir: str, config: dict) -> None:
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = dict(tokenizer["model"]["vocab"])
    vocab.update({added["content"]: added["id"] for added in tokenizer["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    specials = {added["content"] for added in tokenizer["added_tokens"] if added["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]])
    writer.add_token_types([TokenType.CONTROL if t in specials else TokenType.NORMAL for t in tokens])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])


def _gguf_tensor(name: str, value: np.ndarray, gguf_arch: str, config: dict) -> tuple[str, np.ndarray]:
    value = value.astype(np.float32)
    if name in _GLOBAL:
        gguf_name = _GLOBAL[name]
    else:
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        part, kind = rest.rsplit(".", 1)
        gguf_name = f"blk.{layer}.{_PARTS[gguf_arch][part]}.{kind}"
    if gguf_arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        value = _permute(value, config["num_attention_heads"])
    elif gguf_arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        value = _permute(value, config["num_key_value_heads"])
    elif gguf_arch == "gemma3" and name.endswith("norm.weight"):
        value = value + 1.0  # llama.cpp's Gemma converter stores 1 + weight
    return gguf_name, value
