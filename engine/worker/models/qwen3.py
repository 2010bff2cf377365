"""Qwen3: the Llama decoder with an RMSNorm over each head of q and of k before RoPE (no q/k/v bias)."""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine.loading.gguf_spec import LLAMA_LAYER_NAMES, GGUFSpec
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.layers.attention import KVCache
from sluice.engine.worker.layers.fp8_activations import Fp8Activations
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.engine.worker.layers.rotary import Rope
from sluice.engine.worker.models.causal_lm import CausalLM
from sluice.engine.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer: int) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.qkv_proj = CausalLM.qkv_proj(arch, bias=arch.attention_bias)
        self.o_proj = CausalLM.o_proj(arch)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.attn = CausalLM.attention(arch, layer, scale=arch.head_dim**-0.5)

    def forward(
        self,
        hidden: torch.Tensor | Fp8Activations,
        rope: Rope,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))  # this rank's heads
        q = self.q_norm.norm(q.reshape(q.shape[0], -1, self.head_dim))
        k = self.k_norm.norm(k.reshape(k.shape[0], -1, self.head_dim))
        return self.o_proj(self.attn(q, k, v.view(k.shape), kv_cache, metadata, rope))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """forward(input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, hidden_size]."""

    decoder_layer = Qwen3DecoderLayer
    gguf_specs = {
        "qwen3": GGUFSpec(
            layer_names={
                **LLAMA_LAYER_NAMES,
                "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm",
            }
        )
    }
