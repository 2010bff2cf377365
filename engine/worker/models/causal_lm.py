"""What every model file shares: meta-device construction, tied embeddings, logits, weight loading.

A model file subclasses `CausalLM`, builds `self.model` (with `embed_tokens`), `self.lm_head` and its rotary
embeddings under `torch.device("meta")`, calls `materialize(kernels)`, and implements `forward(input_ids,
positions, kv_caches, metadata) -> hidden`. Its layers take no kernel choices: `materialize` makes them all,
once, from the runner's `KernelConfig`. Checkpoint names map onto its parameters through `packed_modules`
(`sluice.engine.loading.weight_loader`) and, for GGUF files, its `gguf_specs`
(`sluice.engine.loading.gguf_spec`).

Its projections, embeddings and lm_head are the tensor-parallel layers (`parallel_linear`,
`vocab_parallel_embedding`): with one rank they hold and compute the whole; under tensor parallelism each
rank's part, sized from the `KernelConfig`'s group at `materialize`. A model class whose forward works on
any rank's part of the heads (it splits qkv with `qkv_proj.split`, never with the whole model's sizes) says
`supports_tensor_parallel = True`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from sluice.engine.loading.gguf_spec import GGUFSpec
from sluice.engine.loading.model_arch import ModelArchConfig, RopeScaling
from sluice.engine.loading.weight_loader import load_weights
from sluice.engine.worker.layers.attention import Attention
from sluice.engine.worker.layers.custom_op import CustomOp
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear import LinearBase
from sluice.engine.worker.layers.parallel_linear import ParallelLMHead, QKVParallelLinear, RowParallelLinear
from sluice.engine.worker.layers.rotary import RotaryEmbedding
from sluice.engine.worker.layers.vocab_parallel_embedding import VocabParallelEmbedding

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
    supports_tensor_parallel: ClassVar[bool] = False

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.tie_word_embeddings = arch.tie_word_embeddings

    def materialize(self, kernels: KernelConfig | None) -> None:
        """Choose every layer's kernels, once, and allocate the (meta-built) parameters, uninitialized, in
        `kernels.dtype` on `kernels.device`; tie lm_head. kernels None: float32 on the meta device, a model
        built only to read its parameters' names and shapes.

        Each linear gets its `LinearMethod` first, which creates its parameters (still on meta), and each
        linear and the embeddings size this rank's part under tensor parallelism; then, on the device, each
        `CustomOp` (norms, activations, rotary) picks its implementation and each attention layer takes the
        backend and its heads."""
        kernels = kernels or KernelConfig(torch.device("meta"), torch.float32)
        self.kernels = kernels
        self.to(kernels.dtype)
        with torch.device("meta"):
            for prefix, module in self.named_modules():
                if isinstance(module, LinearBase | VocabParallelEmbedding):
                    module.select(kernels, prefix)
        if kernels.device.type != "meta":
            # `to_empty` less its empty_like, whose meta-to-device path is torch's Python reference (its first
            # call imports sympy: ~0.5 s of every engine start).
            device = kernels.device
            self._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
        for module in self.modules():
            if isinstance(module, CustomOp | Attention):
                module.select(kernels)
        if self.tie_word_embeddings:
            self.lm_head.tie_weight(self.model.embed_tokens.weight)

    @classmethod
    def gguf_derived_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """config.json entries a GGUF file cannot state and llama.cpp derives from its shape (`config`: what
        the loader read from the file so far); none unless the model class says."""
        return {}

    def rope(self, theta: float, scaling: RopeScaling | None, max_positions: int | None) -> RotaryEmbedding:
        return RotaryEmbedding(
            self.arch.head_dim, max_positions or self.arch.max_position_embeddings, theta, scaling
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named tensors -> parameters; see
        `sluice.engine.loading.weight_loader.load_weights`."""
        load_weights(self, weights)

    @staticmethod
    def qkv_proj(arch: ModelArchConfig, bias: bool) -> QKVParallelLinear:
        heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        return QKVParallelLinear(arch.hidden_size, arch.head_dim, heads, kv_heads, bias)

    @staticmethod
    def o_proj(arch: ModelArchConfig) -> RowParallelLinear:
        return RowParallelLinear(arch.q_size, arch.hidden_size, arch.o_proj_bias)

    @staticmethod
    def lm_head_for(arch: ModelArchConfig) -> ParallelLMHead:
        return ParallelLMHead(arch.hidden_size, arch.vocab_size)

    @staticmethod
    def attention(arch: ModelArchConfig, layer: int, scale: float) -> Attention:
        """Layer `layer`'s paged attention, windowed when the architecture says so."""
        heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        window = arch.layer_sliding_window(layer)
        return Attention(heads, kv_heads, arch.head_dim, scale, window)
