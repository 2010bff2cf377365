"""A loaded Llama-family model's decoder layers and final norm as one C++ call per step on CPU
(`kernels/cpu_decoder_stack.h`).

The stack runs the kernels the layers run one at a time, in the same order with the same roundings, so the
hidden states equal the per-layer path's; it drops the Python and dispatch between ~300 kernel calls a step
(docs/BENCHMARKS.md, "Figures behind the code"). The runner decides, after
loading (`build_cpu_stack`): the model keeps its per-layer path, and the reason is logged, unless it is a
`LlamaForCausalLM` with exactly `LlamaDecoderLayer` layers and every layer runs the float32 CPU kernels:

    linears   `CpuPackedLinearMethod`, quantized or not; a bias on qkv_proj only (Qwen2)
    norms     RMSNorm on the C++ kernel; the same eps everywhere
    rotary    the C++ kernel's cos|sin table
    attention the C++ backend (`sluice.engine.worker.attention.cpu_backend`), one scale (windows per layer),
              a KV cache in the model dtype
    mlp       SiLU gate
    one rank  no tensor parallelism (its all-reduces sit between the projections, outside the C++ call)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from sluice.engine.worker.attention.cpu_backend import CpuAttentionBackend
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.layers.activation import SiluAndMul
from sluice.engine.worker.layers.attention import KVCache
from sluice.engine.worker.layers.linear import LinearBase
from sluice.engine.worker.layers.linear_method import CpuPackedLinearMethod
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.engine.worker.layers.quantization import CpuQuantizedLinearMethod, QuantizedWeight
from sluice.engine.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from sluice.kernels.cpu_decoder_stack import EXTENSION, StackLayer, StackShape, make_decoder_stack
from sluice.kernels.cpu_extension import cpu_extension_unavailable_reason

logger = logging.getLogger(__name__)


def build_cpu_stack(model: nn.Module) -> LlamaCpuStack | None:
    """The stack over a loaded model's layers, or None with the reason logged (the model then runs layer
    by layer). Off the CPU nothing is logged: the stack is a CPU path."""
    if model.kernels.device.type != "cpu":
        return None
    reason = unavailable_reason(model)
    if reason is not None:
        logger.info("decoder layers run one call each: %s", reason)
        return None
    logger.info("decoder layers run as one C++ call per step (kernels/%s.cpp)", EXTENSION)
    return LlamaCpuStack(model)


class LlamaCpuStack:
    """`stack(input_ids, positions, kv_caches, metadata) -> hidden`, the model's forward's result."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        layers, norm = model.model.layers, model.model.norm
        attn = layers[0].self_attn.attn
        shape = StackShape(
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate_size=layers[0].mlp.down_proj.input_size,
            eps=norm.eps,
            scale=attn.scale,
        )
        self.embed_tokens = model.model.embed_tokens
        self.cos_sin_cache = model.rotary.cos_sin_cache
        self._stack = make_decoder_stack([_stack_layer(layer) for layer in layers], norm.weight, shape)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.run(self.embed_tokens(input_ids), positions, kv_caches, metadata)

    def run(
        self,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """embeddings [T, hidden] (overwritten: the residual stream) -> the final norm's output."""
        return self._stack.forward(
            embeddings,
            positions,
            self.cos_sin_cache,
            [k_cache for k_cache, _ in kv_caches],
            [v_cache for _, v_cache in kv_caches],
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
        )

    @property
    def team(self) -> bool:
        """Whether a step runs as one team of threads (kernels/cpu_team.h: the default, unless a projection
        is quantized) or as one parallel region per kernel (the team's baseline in
        `sluice.benchmarks.engine.cpu_team`). Setting True on a quantized stack raises RuntimeError."""
        return self._stack.team

    @team.setter
    def team(self, team: bool) -> None:
        self._stack.team = team


def unavailable_reason(model: nn.Module) -> str | None:
    """None when the model is Llama-layout and every layer runs the float32 CPU kernels the stack calls, else
    the first reason not."""
    if not isinstance(model, LlamaForCausalLM) or type(model).decoder_layer is not LlamaDecoderLayer:
        return f"{type(model).__name__}'s layers are not the Llama decoder layer the stack runs"
    if model.kernels.tensor_parallel.size > 1:
        return "tensor parallel: the ranks all-reduce between the layers' projections"
    layers, norm = model.model.layers, model.model.norm
    if not layers:
        return "the model has no layers"
    if model.rotary.implementation != "cpu":
        return "rotary does not run the C++ kernel (not float32 on cpu)"
    scales = {layer.self_attn.attn.scale for layer in layers}
    if len(scales) > 1:
        return f"attention scales differ across layers: {sorted(scales)}"
    norms = [norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(type(n) is not RMSNorm or n.implementation != "cpu" or n.eps != norm.eps for n in norms):
        return "a norm is not the C++ RMSNorm with the model's eps"
    for i, layer in enumerate(layers):
        attn = layer.self_attn.attn
        if not isinstance(attn.backend, CpuAttentionBackend):
            return f"layer {i}: attention is not the C++ backend"
        if attn.backend.kv_cache_dtype is not None:
            return f"layer {i}: the KV cache is {attn.backend.kv_cache_dtype}; not the model dtype"
        if type(layer.mlp.act) is not SiluAndMul:
            return f"layer {i}: the MLP's activation is not SiLU"
        linears = _projections(layer)
        if any(not isinstance(_float_method(linear), CpuPackedLinearMethod) for linear in linears):
            return f"layer {i}: a projection is not packed for the C++ kernel"
        if any(linear.bias is not None for linear in linears[1:]):
            return f"layer {i}: o_proj, gate_up_proj or down_proj has a bias"
    return cpu_extension_unavailable_reason(EXTENSION)


def _float_method(linear: LinearBase) -> object:
    """The method that runs the layer's float weight (a quantized layer's larger steps)."""
    method = linear.method
    return method.float_method if isinstance(method, CpuQuantizedLinearMethod) else method


def _quantized(linear: LinearBase) -> QuantizedWeight | None:
    return linear.quantized if isinstance(linear.method, CpuQuantizedLinearMethod) else None


def _projections(layer: nn.Module) -> tuple[LinearBase, LinearBase, LinearBase, LinearBase]:
    """qkv_proj, o_proj, gate_up_proj, down_proj: the order the stack takes their quantized forms in."""
    attention, mlp = layer.self_attn, layer.mlp
    return attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj


def _stack_layer(layer: nn.Module) -> StackLayer:
    attention, mlp = layer.self_attn, layer.mlp
    qkv: LinearBase = attention.qkv_proj
    quantized = (_quantized(linear) for linear in _projections(layer))
    return StackLayer(
        input_norm=layer.input_layernorm.weight,
        qkv=qkv.packed,
        qkv_bias=qkv.bias,
        o=attention.o_proj.packed,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=mlp.gate_up_proj.packed,
        down=mlp.down_proj.packed,
        sliding_window=attention.attn.sliding_window,
        quantized=tuple(None if q is None else q.kernel_args() for q in quantized),
    )
