"""Linear layers that own their weights: how checkpoint tensors land in them, and how the backend reads them.

    ReplicatedLinear      one checkpoint tensor -> one weight            (o_proj, down_proj, lm_head)
    MergedLinear          n checkpoint tensors  -> row slices of one weight (gate_up_proj = [gate; up])
    QKVLinear             MergedLinear with shards q, k, v              (qkv_proj = [q; k; v])

    weight [sum(output_sizes), input_size]:   rows 0 .. q-1 | q .. q+kv-1 | q+kv .. q+2kv-1
                                              shard 0 (q)   | shard 1 (k) | shard 2 (v)

Loading goes through `weight_loader(param, tensor, shard)`: the generic loader
(`sluice.engine.loading.weight_loader`) never knows how a layer lays out its weight. After every tensor is in,
`process_weights_after_loading()` runs once per layer: the single place where a backend-specific layout
(pre-transposed CPU weights, quantized packing, tensor-parallel slices) is made from the loaded weight.
`forward` calls `apply`, which reads whatever that layout is.

On CPU, a float32 weight is packed in column panels for the C++ kernel in `kernels/cpu_packed_linear.h`
(`packed` [num_panels, input_size, panel width]; each matmul streams them front to back, 1.2-7x faster than
MKL's sgemm on decode-sized steps). The packed tensor replaces the weight's data, so memory stays flat,
except for a weight tied to the embeddings (`tie_weight`), which keeps its rows for the lookups and gets a
packed copy. Without the kernel (another dtype, no C++ compiler) the weight is stored column-major:
`weight.t()` is a contiguous [input_size, output_size] matrix, so `F.linear` hands MKL an untransposed
operand (its sgemm on a transposed one is 2-4.6x slower for 4-32 rows). With `quantization` set ("int4" /
"int8", `sluice.engine.worker.layers.quantization`) the layer also keeps a quantized copy, used for steps
of up to `quantized.max_rows` rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.worker.layers.quantization import (
    QuantizedWeight,
    quantize_weight,
    unsupported_reason,
)
from sluice.kernels.cpu_packed_linear import (
    pack_weight,
    packed_linear_prechecked,
    packed_linear_unavailable_reason,
)


class LinearBase(nn.Module):
    """y = x W^T (+ b). weight: [output_size, input_size]; bias: [output_size] when `bias`."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__()
        if not output_sizes or min(output_sizes) <= 0 or input_size <= 0:
            raise ValueError(f"output_sizes: must be positive, got {tuple(output_sizes)} x {input_size}")
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        self.output_size = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(self.output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False) if bias else None
        # Set before loading (`set_quantization`); the hook then builds `quantized` from the weight.
        self.quantization: str | None = None
        self.quantized: QuantizedWeight | None = None
        self.weight_is_tied = False
        # Made by the hook on CPU: the weight in column panels (`sluice.kernels.cpu_packed_linear`).
        self.packed: torch.Tensor | None = None

    @property
    def num_shards(self) -> int:
        """Checkpoint tensors per parameter (1 unless the layer packs several projections)."""
        return len(self.output_sizes)

    def shard_slice(self, shard: int) -> slice:
        """Rows of the packed weight (and bias) that checkpoint shard `shard` fills."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Copy checkpoint tensor `loaded` into `param` (all of it, or shard `shard`'s rows), casting to
        the parameter's dtype. Raises ValueError on a shape mismatch."""
        target = param.data if shard is None else param.data[self.shard_slice(shard)]
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded)

    def set_quantization(self, method: str | None) -> None:
        """Quantize this layer's weight when loaded (None: keep it float). Raises ValueError naming
        `quantization` when `method` cannot quantize it."""
        if method is not None and (reason := unsupported_reason(method, self.weight)):
            raise ValueError(f"quantization: {method} {reason}")
        self.quantization = method

    def tie_weight(self, weight: nn.Parameter) -> None:
        """Share `weight` (the embeddings) instead of owning one; the hook leaves its rows as they are."""
        self.weight = weight
        self.weight_is_tied = True

    def process_weights_after_loading(self) -> None:
        """Hook run once after loading: on CPU, the packed (or column-major) layout and the quantized copy.
        After it, an untied packed layer's `weight` holds the panels [num_panels, input_size, panel width]."""
        if self.weight.device.type != "cpu":
            return
        if self.quantization is not None:
            self.quantized = quantize_weight(self.quantization, self.weight.data)
        if packed_linear_unavailable_reason(self.weight) is None:
            self.packed = pack_weight(self.weight.data)
            if not self.weight_is_tied:
                self.weight.data = self.packed
        else:
            # In place on the parameter, so a tied embedding shares the layout (lookups read strided rows).
            self.weight.data = self.weight.data.t().contiguous().t()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size], from the layout `process_weights_after_loading` made."""
        if self.quantized is not None and x.shape[0] <= self.quantized.max_rows:
            return self.quantized.matmul(x, self.bias)
        if self.packed is not None:
            return packed_linear_prechecked(x, self.packed, self.output_size, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x)


class ReplicatedLinear(LinearBase):
    """One checkpoint tensor, whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, (output_size,), bias)


class MergedLinear(LinearBase):
    """Several projections of the same input, stacked by rows (e.g. gate_up_proj = [gate; up])."""

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[..., output_size] -> one view per shard."""
        return y.split(self.output_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul: shards 0, 1, 2 of sizes num_heads, num_kv_heads, num_kv_heads
    times head_dim."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, (q_size, kv_size, kv_size), bias)
