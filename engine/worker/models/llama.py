"""Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2) over a paged KV cache.

Parameter names follow Hugging Face except two fused projections:
    self_attn.qkv_proj  = [q_proj; k_proj; v_proj]   (rows concatenated; Qwen2 biases likewise)
    mlp.gate_up_proj    = [gate_proj; up_proj]
`load_weights` takes Hugging Face names and fills the fused slices.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import import_module

import torch
import torch.nn.functional as F
from torch import nn

from engine.loading.model_arch import ModelArchConfig
from engine.worker.attention.backend import AttentionBackend
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.models.rotary import Rope, RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


class RMSNorm(nn.Module):
    """`norm(x, residual=None) -> (normed, residual_out)`, rounded like transformers' LlamaRMSNorm.

    With `residual`, x + residual (in x's dtype) is normalized and also returned as the next residual:
    the decoder's residual stream flows through the norms, so the add fuses into the norm kernel.
    use_triton: `kernels.rms_norm.rms_norm`, one pass over each row; else plain PyTorch.
    """

    def __init__(self, hidden_size: int, eps: float, use_triton: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = use_triton
        # Imported only when used: triton is not installed everywhere the torch path runs.
        self._fused = import_module("kernels.rms_norm").rms_norm if use_triton else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fused is not None:
            return self._fused(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype), x


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.q_size
        self.kv_size = arch.kv_size
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: Rope,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """(hidden, residual) -> (hidden, residual); the layer's output is their sum, which the next norm
    forms (fused with the norm when use_triton). The first layer gets residual None."""

    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, use_triton: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, use_triton)
        self.self_attn = LlamaAttention(arch, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, use_triton)
        self.mlp = LlamaMLP(arch)

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
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, use_triton: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, backend, use_triton) for _ in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, use_triton)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, hidden_size].

    use_triton_kernels: RMSNorm (+ residual add) and rotary run as the fused Triton kernels in
    `kernels/` (on CUDA, or on CPU under TRITON_INTERPRET=1); otherwise plain PyTorch.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int | None = None,
        use_triton_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.arch = arch
        # Built on the meta device so no memory is touched until the real (empty) storage is allocated.
        with torch.device("meta"):
            self.model = LlamaModel(arch, backend, use_triton_kernels)
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.to(dtype)
        self.to_empty(device=device)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            arch.head_dim,
            max_positions or arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
            dtype,
            device,
            use_triton=use_triton_kernels,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden, residual = self.model.embed_tokens(input_ids), None
        rope = self.rotary.bind(positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, metadata)
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters (casting to the model dtype).

        Rotary `inv_freq` buffers are skipped; a missing `lm_head.weight` means tied embeddings.
        Raises ValueError on an unknown name, a shape mismatch or a missing weight.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            param_name, start = self._copy_weight(params, name, tensor)
            loaded.add((param_name, start))
        expected = [self._locate(name)[:2] for name, _ in hf_weight_shapes(self.arch)]
        missing = [key for key in expected if key not in loaded]
        if ("lm_head.weight", 0) in missing:
            self.lm_head.weight = self.model.embed_tokens.weight
            missing.remove(("lm_head.weight", 0))
        if missing:
            raise ValueError(f"weights: missing {sorted(name for name, _ in missing)}")

    def _copy_weight(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
    ) -> tuple[str, int]:
        param_name, start, size = self._locate(name)
        if param_name not in params:
            raise ValueError(f"weights: unexpected tensor {name!r}")
        target = params[param_name].data
        if size is not None:
            target = target[start : start + size]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        return param_name, start

    def _locate(self, name: str) -> tuple[str, int, int | None]:
        """HF name -> (our parameter name, row offset, rows) for fused slices; (name, 0, None) otherwise."""
        for hf_part, fused_part, start, size in self._fused_slices():
            if f".{hf_part}." in name:
                return name.replace(f".{hf_part}.", f".{fused_part}."), start, size
        return name, 0, None

    def _fused_slices(self) -> tuple[tuple[str, str, int, int], ...]:
        q, kv, inter = self.arch.q_size, self.arch.kv_size, self.arch.intermediate_size
        return (
            ("q_proj", "qkv_proj", 0, q),
            ("k_proj", "qkv_proj", q, kv),
            ("v_proj", "qkv_proj", q + kv, kv),
            ("gate_proj", "gate_up_proj", 0, inter),
            ("up_proj", "gate_up_proj", inter, inter),
        )


def hf_weight_shapes(arch: ModelArchConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face parameter names and shapes of a checkpoint for `arch`, in checkpoint order."""
    h, inter, q, kv = arch.hidden_size, arch.intermediate_size, arch.q_size, arch.kv_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (arch.vocab_size, h))]
    for i in range(arch.num_hidden_layers):
        prefix = f"model.layers.{i}"
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes.append((f"{prefix}.self_attn.{proj}.weight", (rows, h)))
            if arch.attention_bias:
                shapes.append((f"{prefix}.self_attn.{proj}.bias", (rows,)))
        shapes += [
            (f"{prefix}.self_attn.o_proj.weight", (h, q)),
            (f"{prefix}.mlp.gate_proj.weight", (inter, h)),
            (f"{prefix}.mlp.up_proj.weight", (inter, h)),
            (f"{prefix}.mlp.down_proj.weight", (h, inter)),
            (f"{prefix}.input_layernorm.weight", (h,)),
            (f"{prefix}.post_attention_layernorm.weight", (h,)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not arch.tie_word_embeddings:
        shapes.append(("lm_head.weight", (arch.vocab_size, h)))
    return shapes
