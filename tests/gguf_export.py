"""Write a tiny Hugging Face Llama checkpoint (see checkpoints.py) as a GGUF the way llama.cpp's
`convert_hf_to_gguf.py` does: q/k rows permuted, F32 tensors, the byte-level BPE vocabulary, and for
a "llama3" rope_scaling a `rope_freqs.weight` tensor of per-frequency divisors (Llama 3.1+ files)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from safetensors.numpy import load_file

_LAYER_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def llama3_rope_factors(config: dict) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, in effect (float64, then f32)."""
    rope = config.get("rope_scaling") or config["rope_parameters"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
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
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_llama_gguf(hf_dir: str, path: str) -> str:
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = dict(tokenizer["model"]["vocab"])
    for added in tokenizer["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {added["content"] for added in tokenizer["added_tokens"] if added["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]]
    writer = GGUFWriter(path, "llama")
    writer.add_name("Tiny Llama 3.1")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta") or config.get("rope_theta"))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([TokenType.CONTROL if t in specials else TokenType.NORMAL for t in tokens])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if rope.get("rope_type") == "llama3":
        writer.add_tensor(
            "rope_freqs.weight", llama3_rope_factors(config), raw_dtype=GGMLQuantizationType.F32
        )
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, value in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        writer.add_tensor(_gguf_name(name), _layout(name, value, heads, kv_heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def _layout(name: str, value: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    value = value.astype(np.float32)
    if name.endswith("q_proj.weight"):
        return _permute(value, heads)
    if name.endswith("k_proj.weight"):
        return _permute(value, kv_heads)
    return value
