"""Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2) over a paged KV cache.

Parameter names follow Hugging Face except two packed projections (see `sluice.engine.worker.layers.linear`):
    self_attn.qkv_proj  = [q_proj; k_proj; v_proj]   (rows concatenated; Qwen2 biases likewise)
    mlp.gate_up_proj    = [gate_proj; up_proj]
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine.loading.gguf_spec import GGUFSpec
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.layers.attention import KVCache
from sluice.engine.worker.layers.fp8_activations import Fp8Activations
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.mlp import GatedMLP
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.engine.worker.layers.rotary import Rope
from sluice.engine.worker.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sluice.engine.worker.models.causal_lm import CausalLM


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer: int) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.qkv_proj = CausalLM.qkv_proj(arch, bias=arch.attention_bias)
        self.o_proj = CausalLM.o_proj(arch)
        self.attn = CausalLM.attention(arch, layer, scale=arch.head_dim**-0.5)

    def forward(
        self,
        hidden: torch.Tensor | Fp8Activations,
        rope: Rope,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))  # this rank's heads
        q = q.view(q.shape[0], -1, self.head_dim)
        k = k.view(k.shape[0], -1, self.head_dim)
        return self.o_proj(self.attn(q, k, v.view(k.shape), kv_cache, metadata, rope))


class LlamaDecoderLayer(nn.Module):
    """(hidden, residual) -> (hidden, residual); the layer's output is their sum, which the next norm
    forms (in the norm's kernel, where it has one). The first layer gets residual None."""

    attention_class: type[nn.Module] = LlamaAttention

    def __init__(self, arch: ModelArchConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(arch, layer)
        # config.json's hidden_act; get_act_and_mul refuses, naming hidden_act, one it does not run.
        activation = arch.extra.get("hidden_act") or "silu"
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, activation, arch.mlp_bias)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm feeds one linear: an FP8 one may take the norm's output already quantized (norm_for).
        hidden, residual = self.input_layernorm.norm_for(self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.norm_for(self.mlp.gate_up_proj, hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_class: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(layer_class(arch, i) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """forward(input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, hidden_size].

    Its norms (+ residual add), rotary and activation run whichever kernels `kernels` chose (Triton's, the C++
    CPU ones, or plain PyTorch). With `decoder_layer` exactly `LlamaDecoderLayer`, the runner may run
    `model.layers` and `model.norm` as one C++ call per step instead
    (`sluice.engine.worker.models.llama_cpu_stack`), with the same result.
    """

    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    supports_tensor_parallel = True
    # llama.cpp's converter interleaves Llama's q/k rotary rows; Qwen2's it keeps.
    gguf_specs = {"llama": GGUFSpec(permute_qk=True), "qwen2": GGUFSpec()}

    def __init__(
        self, arch: ModelArchConfig, kernels: KernelConfig | None, max_positions: int | None = None
    ) -> None:
        """kernels: see `CausalLM.materialize`."""
        super().__init__(arch)
        with torch.device("meta"):
            self.model = LlamaModel(arch, self.decoder_layer)
            self.lm_head = CausalLM.lm_head_for(arch)
            self.rotary = self.rope(arch.rope_theta, arch.rope_scaling, max_positions)
        self.materialize(kernels)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden, residual = self.model.embed_tokens(input_ids), None
        rope = self.rotary(positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, metadata)
        return self.model.norm(hidden, residual)[0]
