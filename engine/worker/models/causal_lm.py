"""What every model file shares: meta-device construction, tied embeddings, logits, weight loading.

A model file subclasses `CausalLM`, builds `self.model` (with `embed_tokens`) and `self.lm_head` under
`torch.device("meta")`, calls `materialize`, and implements `forward(input_ids, positions, kv_caches,
metadata) -> hidden`. Checkpoint names map onto its parameters through `packed_modules`
(`sluice.engine.loading.weight_loader`) and, for GGUF files, its `gguf_specs`
(`sluice.engine.loading.gguf_spec`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from sluice.engine.loading.gguf_spec import GGUFSpec
from sluice.engine.loading.model_arch import ModelArchConfig, RopeScaling
from sluice.engine.loading.weight_loader import load_weights
from sluice.engine.worker.attention.backend import AttentionBackend
from sluice.engine.worker.layers.attention import Attention
from sluice.engine.worker.layers.linear import LinearBase, QKVLinear, ReplicatedLinear
from sluice.engine.worker.layers.rotary import RotaryEmbedding

# checkpoint module -> (our packed module, shard)
PACKED_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CausalLM(nn.Module):
    """Base of the model classes in this package (see the module docstring)."""

    packed_modules: ClassVar[dict[str, tuple[str, int]]] = PACKED_QKV_GATE_UP
    gguf_specs: ClassVar[dict[str, GGUFSpec]] = {}  # GGUF general.architecture -> its layout

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.tie_word_embeddings = arch.tie_word_embeddings

    def materialize(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the (meta-built) parameters, uninitialized, in `dtype` on `device`; tie lm_head."""
        self.dtype = dtype
        self.to(dtype)
        self.to_empty(device=device)
        if self.tie_word_embeddings:
            self.lm_head.tie_weight(self.model.embed_tokens.weight)

    def rope(
        self,
        theta: float,
        scaling: RopeScaling | None,
        max_positions: int | None,
        device: torch.device,
        use_triton: bool,
    ) -> RotaryEmbedding:
        return RotaryEmbedding(
            self.arch.head_dim,
            max_positions or self.arch.max_position_embeddings,
            theta,
            scaling,
            self.dtype,
            device,
            use_triton=use_triton,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        return self.lm_head(hidden).float()

    def set_quantization(self, method: str | None) -> None:
        """Weight-only quantization of every linear layer when the weights load (None: none). Under int4
        lm_head takes int8: its error reaches the logits directly, and it is a tenth of the weights."""
        for module in self.modules():
            if isinstance(module, LinearBase):
                is_head = module is self.lm_head and method == "int4"
                module.set_quantization("int8" if is_head else method)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named tensors -> parameters; see
        `sluice.engine.loading.weight_loader.load_weights`."""
        load_weights(self, weights)

    @staticmethod
    def qkv_proj(arch: ModelArchConfig, bias: bool) -> QKVLinear:
        heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        return QKVLinear(arch.hidden_size, arch.head_dim, heads, kv_heads, bias)

    @staticmethod
    def o_proj(arch: ModelArchConfig) -> ReplicatedLinear:
        return ReplicatedLinear(arch.q_size, arch.hidden_size)

    @staticmethod
    def lm_head_for(arch: ModelArchConfig) -> ReplicatedLinear:
        return ReplicatedLinear(arch.hidden_size, arch.vocab_size)

    @staticmethod
    def attention(arch: ModelArchConfig, layer: int, backend: AttentionBackend, scale: float) -> Attention:
        """Layer `layer`'s paged attention, windowed when the architecture says so."""
        heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        window = arch.layer_sliding_window(layer)
        return Attention(heads, kv_heads, arch.head_dim, scale, backend, window)
