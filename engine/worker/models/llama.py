"""Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2) over a paged KV cache.

Parameter names follow Hugging Face except two packed projections (see `sluice.engine.worker.layers.linear`):
    self_attn.qkv_proj  = [q_proj; k_proj; v_proj]   (rows concatenated; Qwen2 biases likewise)
    mlp.gate_up_proj    = [gate_proj; up_proj]
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from sluice.engine.loading.gguf_spec import GGUFSpec
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.worker.attention.backend import AttentionBackend
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.layers.attention import KVCache
from sluice.engine.worker.layers.mlp import GatedMLP
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.engine.worker.layers.rotary import Rope
from sluice.engine.worker.models.causal_lm import CausalLM
from sluice.engine.worker.models.llama_cpu_stack import LlamaCpuStack


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer: int, backend: AttentionBackend, use_triton: bool):
        super().__init__()
        self.sizes = [arch.q_size, arch.kv_size, arch.kv_size]
        self.head_dim = arch.head_dim
        self.qkv_proj = CausalLM.qkv_proj(arch, bias=arch.attention_bias)
        self.o_proj = CausalLM.o_proj(arch)
        self.attn = CausalLM.attention(arch, layer, backend, scale=arch.head_dim**-0.5)

    def forward(
        self, hidden: torch.Tensor, rope: Rope, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.sizes, dim=-1)
        q = q.view(q.shape[0], -1, self.head_dim)
        k = k.view(k.shape[0], -1, self.head_dim)
        q, k = rope(q, k)
        return self.o_proj(self.attn(q, k, v.view(k.shape), kv_cache, metadata))


class LlamaDecoderLayer(nn.Module):
    """(hidden, residual) -> (hidden, residual); the layer's output is their sum, which the next norm
    forms (fused with the norm when use_triton). The first layer gets residual None."""

    attention_class: type[nn.Module] = LlamaAttention

    def __init__(self, arch: ModelArchConfig, layer: int, backend: AttentionBackend, use_triton: bool):
        super().__init__()
        self.self_attn = self.attention_class(arch, layer, backend, use_triton)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, "silu")
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, use_triton)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, use_triton)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, use_triton: bool, layer_class: type):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            layer_class(arch, i, backend, use_triton) for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, use_triton)


class LlamaForCausalLM(CausalLM):
    """forward(input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, hidden_size].

    use_triton_kernels: RMSNorm (+ residual add) and rotary run as the fused Triton kernels in
    `kernels/` (on CUDA, or on CPU under TRITON_INTERPRET=1); otherwise plain PyTorch, or the C++ kernels
    on CPU in float32. When every layer runs those, the loaded model runs its layers as one C++ call per
    step (`cpu_stack`, `sluice.engine.worker.models.llama_cpu_stack`), with the same result.
    """

    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    # llama.cpp's converter interleaves Llama's q/k rotary rows; Qwen2's it keeps.
    gguf_specs = {"llama": GGUFSpec(permute_qk=True), "qwen2": GGUFSpec()}

    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int | None = None,
        use_triton_kernels: bool = False,
    ) -> None:
        super().__init__(arch)
        with torch.device("meta"):
            self.model = LlamaModel(arch, backend, use_triton_kernels, self.decoder_layer)
            self.lm_head = CausalLM.lm_head_for(arch)
        self.materialize(dtype, device)
        self.rotary = self.rope(arch.rope_theta, arch.rope_scaling, max_positions, device, use_triton_kernels)
        self.cpu_stack: LlamaCpuStack | None = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        if type(self).decoder_layer is LlamaDecoderLayer:  # the stack runs this layer, not a subclass's
            self.cpu_stack = LlamaCpuStack.build(self.model.layers, self.model.norm, self.rotary)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden, residual = self.model.embed_tokens(input_ids), None
        if self.cpu_stack is not None:
            return self.cpu_stack(hidden, positions, kv_caches, metadata)
        rope = self.rotary.bind(positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, metadata)
        return self.model.norm(hidden, residual)[0]
