"""A Llama-style decoder stack as one C++ call per step, float32 on CPU (`cpu_decoder_stack.h`).

    stack = make_decoder_stack(layers, final_norm, shape)           once, after loading
    hidden = stack.forward(embeddings, positions, cos_sin, ...)      every step

It calls the kernels the layers call one by one (`cpu_packed_linear`, `cpu_rms_norm`, `cpu_rotary`,
`cpu_paged_attention`, `cpu_silu_and_mul`), in the same order, so its reference is the model's own
per-layer path: the tests compare the two, and transformers, on mixed batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.kernels.cpu_extension import require_cpu_extension

EXTENSION = "cpu_decoder_stack"
# A quantized projection as the stack's C++ side takes it: (weight, scales, group_size, max_rows), see
# `sluice.engine.worker.layers.quantization`.
QuantizedArgs = tuple[torch.Tensor, torch.Tensor, int, int]


@dataclass(frozen=True)
class StackLayer:
    """One layer as the stack runs it: its weights as the kernels read them (norms [hidden]; projections
    packed in column panels by `sluice.kernels.cpu_packed_linear.pack_weight`; qkv_bias [q_size + 2 * kv_size]
    or None), its attention's sliding window (None: the whole context), and the projections' quantized forms
    (qkv, o, gate_up, down: each None or `QuantizedWeight.kernel_args()`)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    sliding_window: int | None
    quantized: tuple[QuantizedArgs | None, ...] = (None, None, None, None)


@dataclass(frozen=True)
class StackShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    scale: float  # attention's softmax scale


def make_decoder_stack(layers: Sequence[StackLayer], final_norm: torch.Tensor, shape: StackShape):
    """The C++ `DecoderStack` over these weights (held by reference, not copied). Raises RuntimeError if
    the kernel is not built. Its `forward(embeddings, positions, cos_sin, k_caches, v_caches, slot_mapping,
    block_tables, query_start_loc, seq_lens)` overwrites `embeddings` [T, hidden] with the residual stream
    and returns the final norm's output [T, hidden]."""
    module = require_cpu_extension(EXTENSION)
    return module.DecoderStack(
        [layer.input_norm for layer in layers],
        [layer.qkv for layer in layers],
        [layer.qkv_bias for layer in layers],
        [layer.o for layer in layers],
        [layer.post_norm for layer in layers],
        [layer.gate_up for layer in layers],
        [layer.down for layer in layers],
        [layer.sliding_window or 0 for layer in layers],
        [list(layer.quantized) for layer in layers],
        final_norm,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.intermediate_size,
        shape.eps,
        shape.scale,
    )
