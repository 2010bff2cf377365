"""Gemma 3 text decoder (Gemma3ForCausalLM): GeLU-tanh MLP, q/k norms, norms before and after both
attention and MLP, a scaled embedding, and local (sliding-window) layers interleaved with global ones,
each kind with its own RoPE base.

Norms follow transformers' Gemma3RMSNorm (`(1 + weight) * normed`, fp32) and the residual adds are the
plain ones of transformers' decoder layer, so every backend gets the same roundings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sluice.engine.loading.gguf_spec import LLAMA_LAYER_NAMES, GGUFSpec
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.rope_scaling import rope_parameters, rope_scaling_from_config
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.layers.attention import KVCache
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.mlp import GatedMLP
from sluice.engine.worker.layers.norm import GemmaRMSNorm
from sluice.engine.worker.layers.rotary import Rope, RotaryEmbedding
from sluice.engine.worker.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sluice.engine.worker.models.causal_lm import CausalLM

GEMMA3_27B_LAYERS = 62  # how llama.cpp tells Gemma 3 27B's GGUF from the others
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256  # transformers' default, where config.json leaves it out


class Gemma3RotaryEmbedding(RotaryEmbedding):
    """Gemma 3 keeps transformers' model-dtype roundings on the Triton backends (the fused kernel rounds
    once, from fp32); on CPU in float32 the C++ kernel rotates in float32, as plain PyTorch does."""

    implementations = ("cpu", "native")


class Gemma3Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer: int) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.is_sliding = arch.layer_sliding_window(layer) is not None
        self.qkv_proj = CausalLM.qkv_proj(arch, bias=arch.attention_bias)
        self.o_proj = CausalLM.o_proj(arch)
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        scale = float(arch.extra.get("query_pre_attn_scalar") or GEMMA3_QUERY_PRE_ATTN_SCALAR) ** -0.5
        self.attn = CausalLM.attention(arch, layer, scale)

    def forward(
        self, hidden: torch.Tensor, rope: Rope, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))  # this rank's heads
        q = self.q_norm(q.reshape(q.shape[0], -1, self.head_dim))
        k = self.k_norm(k.reshape(k.shape[0], -1, self.head_dim))
        return self.o_proj(self.attn(q, k, v.reshape(k.shape), kv_cache, metadata, rope))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer: int) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.self_attn = Gemma3Attention(arch, layer)
        activation = arch.extra.get("hidden_activation") or "gelu_pytorch_tanh"
        self.mlp = GatedMLP(h, arch.intermediate_size, activation, activation_field="hidden_activation")
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self, hidden: torch.Tensor, rope: Rope, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Model(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, i) for i in range(arch.num_hidden_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)


class Gemma3ForCausalLM(CausalLM):
    """forward(input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, hidden_size].

    Global layers rotate with `rope_theta` (and its scaling); local ones with the sliding-attention
    base (config `rope_parameters.sliding_attention` or `rope_local_base_freq`, 10000 by default).
    Norms stay plain PyTorch on every backend and rotary off the Triton kernel (the fused kernels round like
    Llama).
    """

    supports_tensor_parallel = True
    gguf_specs = {
        "gemma3": GGUFSpec(
            layer_names={
                **LLAMA_LAYER_NAMES,
                "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm",
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            },
            config_keys={
                "attention.sliding_window": "sliding_window",
                "final_logit_softcapping": "final_logit_softcapping",
            },
            # As llama.cpp and transformers assume for Gemma 3 files: every 6th layer global.
            config_defaults={"sliding_window_pattern": 6},
            norm_shift=1.0,
        )
    }

    @classmethod
    def gguf_derived_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """query_pre_attn_scalar, as llama.cpp derives it (src/llama-model.cpp, LLM_ARCH_GEMMA3): head_dim,
        but hidden_size / num_attention_heads for Gemma 3 27B, which it knows by its 62 layers. A file
        without a sliding window (or 0: an all-global Gemma 3 such as Rnj-1) has no local layers."""
        scalar = config["head_dim"]
        if config["num_hidden_layers"] == GEMMA3_27B_LAYERS:
            scalar = config["hidden_size"] // config["num_attention_heads"]
        derived: dict[str, Any] = {"query_pre_attn_scalar": scalar}
        if not config.get("sliding_window"):  # absent or 0: no SWA in llama.cpp, every layer global
            derived |= {
                "sliding_window": None,
                "layer_types": ["full_attention"] * config["num_hidden_layers"],
            }
        return derived

    def __init__(
        self, arch: ModelArchConfig, kernels: KernelConfig | None, max_positions: int | None = None
    ) -> None:
        """kernels: see `CausalLM.materialize`."""
        super().__init__(arch)
        local = rope_parameters(arch.extra, "sliding_attention")
        local_theta = float(local.get("rope_theta") or arch.extra.get("rope_local_base_freq") or 10000.0)
        # transformers 5 scales the local layers by their own rope_parameters too
        local_scaling = rope_scaling_from_config(arch.extra, "sliding_attention")
        max_positions = max_positions or arch.max_position_embeddings
        with torch.device("meta"):
            self.model = Gemma3Model(arch)
            self.lm_head = CausalLM.lm_head_for(arch)
            self.rotary_global = Gemma3RotaryEmbedding(
                arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling
            )
            self.rotary_local = Gemma3RotaryEmbedding(
                arch.head_dim, max_positions, local_theta, local_scaling
            )
        self.materialize(kernels)
        # As transformers: sqrt(hidden_size) in fp32, then rounded to the model dtype.
        self.embed_scale = torch.tensor(arch.hidden_size**0.5).to(
            device=self.kernels.device, dtype=self.kernels.dtype
        )
        self.softcap = arch.extra.get("final_logit_softcapping")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids) * self.embed_scale
        rope_global, rope_local = self.rotary_global(positions), self.rotary_local(positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            rope = rope_local if layer.self_attn.is_sliding else rope_global
            hidden = layer(hidden, rope, kv_cache, metadata)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()
