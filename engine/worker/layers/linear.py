"""Linear layers that own their weights: how checkpoint tensors land in them, and how the backend reads them.

    ReplicatedLinear      one checkpoint tensor -> one weight            (o_proj, down_proj, lm_head)
    MergedLinear          n checkpoint tensors  -> row slices of one weight (gate_up_proj = [gate; up])
    QKVLinear             MergedLinear with shards q, k, v              (qkv_proj = [q; k; v])

    weight [sum(output_sizes), input_size]:   rows 0 .. q-1 | q .. q+kv-1 | q+kv .. q+2kv-1
                                              shard 0 (q)   | shard 1 (k) | shard 2 (v)

Loading goes through `weight_loader(param, tensor, shard)`: the generic loader
(`sluice.engine.loading.weight_loader`) never knows how a layer lays out its weight. Everything else about
the weight belongs to the layer's `LinearMethod` (`sluice.engine.worker.layers.linear_method`), chosen at
load by `CausalLM.materialize`: which parameters exist (`create_weights`), the layout the kernel reads, made
once after every tensor is in (`process_weights_after_loading`: packed panels, column-major, a quantized
copy), and the matmul (`apply`). A tensor-parallel layer (`sluice.engine.worker.layers.parallel_linear`)
subclasses these classes: `partition` sets its sizes to its rank's part before the method creates the
weights, and its `weight_loader` takes its rows (or columns) of each checkpoint tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from sluice.engine.distributed.group import TensorParallelGroup
from sluice.engine.worker.layers.fp8_activations import Fp8Activations, Fp8InputScheme
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear_method import (
    GatedRows,
    LinearMethod,
    NormedRows,
    UnquantizedLinearMethod,
)
from sluice.engine.worker.layers.quantization import linear_method_for


class LinearBase(nn.Module):
    """y = x W^T (+ b). weight: [output_size, input_size]; bias: [output_size] when `bias`. Built with an
    `UnquantizedLinearMethod`; `select` (at load) swaps in the method the `KernelConfig` gives it."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__()
        if not output_sizes or min(output_sizes) <= 0 or input_size <= 0:
            raise ValueError(f"output_sizes: must be positive, got {tuple(output_sizes)} x {input_size}")
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        self.output_size = sum(output_sizes)
        # The whole layer's sizes, as the checkpoint has them (a tensor-parallel rank holds a part).
        self.checkpoint_input_size = input_size
        self.checkpoint_output_sizes = self.output_sizes
        self.has_bias = bias
        self.weight_is_tied = False
        self.set_method(UnquantizedLinearMethod(), torch.get_default_dtype())

    def select(self, kernels: KernelConfig, prefix: str) -> None:
        """At load, before the weights exist: take the method `kernels` gives this layer (module name
        `prefix`), which creates its parameters, sized first to this rank's part (`partition`)."""
        self.partition(kernels.tensor_parallel)
        self.set_method(linear_method_for(prefix, self, kernels), kernels.dtype)

    def partition(self, group: TensorParallelGroup) -> None:
        """Set `input_size` and `output_sizes` to rank `group.rank`'s part, before the weights exist. A
        replicated layer holds the whole on every rank."""

    def _set_sizes(self, input_size: int, output_sizes: Sequence[int]) -> None:
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        self.output_size = sum(self.output_sizes)

    def set_method(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Before loading: `method` runs this layer and creates its parameters (in `dtype` for float ones, on
        the current default device), replacing any it had."""
        self.method = method
        method.create_weights(self, self.input_size, self.output_sizes, self.has_bias, dtype)

    @property
    def num_shards(self) -> int:
        """Checkpoint tensors per parameter (1 unless the layer packs several projections)."""
        return len(self.output_sizes)

    def shard_slice(self, shard: int) -> slice:
        """Rows of the packed weight (and bias) that checkpoint shard `shard` fills."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Copy checkpoint tensor `loaded` into `param` (all of it, or shard `shard`'s rows, as the method
        lays them out), casting to the parameter's dtype. Raises ValueError on a shape mismatch."""
        self.method.load_weight(self, param, loaded, shard)

    @property
    def checkpoint_aliases(self) -> Mapping[str, str]:
        """Other names a checkpoint may give this layer's parameters (name -> parameter): the method's."""
        return self.method.checkpoint_aliases

    def checkpoint_shape(self, name: str, shard: int | None) -> tuple[int, ...]:
        """The shape of the checkpoint tensor that fills parameter `name` (shard `shard` of it)."""
        return self.method.checkpoint_shape(self, name, shard)

    def tie_weight(self, weight: nn.Parameter) -> None:
        """Share `weight` (the embeddings) instead of owning one; the method leaves its rows as they are."""
        self.weight = weight
        self.weight_is_tied = True

    def process_weights_after_loading(self) -> None:
        """Run once after loading (`sluice.engine.loading.weight_loader`): the method's layout."""
        self.method.process_weights_after_loading(self)

    def quantized_input(self, num_rows: int) -> Fp8InputScheme | None:
        """Whether (and how) a step of `num_rows` may hand `forward` its input already quantized to FP8, as
        an `Fp8Activations` (the method's `quantized_input`); None: pass the float x."""
        return self.method.quantized_input(self, num_rows)

    def gated_input(self, num_rows: int) -> bool:
        """Whether a step of `num_rows` may hand `forward` a SiLU-gated MLP's [gate | up] rows unactivated,
        as `GatedRows` (the method's `gated_input`: its launch activates them)."""
        return self.method.gated_input(self, num_rows)

    def normed_input(self, num_rows: int) -> bool:
        """Whether a step of `num_rows` may hand `forward` its input before the RMSNorm that makes it, as
        `NormedRows` (the method's `normed_input`: its launch normalizes them)."""
        return self.method.normed_input(self, num_rows)

    def forward(self, x: torch.Tensor | Fp8Activations | GatedRows | NormedRows) -> torch.Tensor:
        """x [..., input_size] (or its FP8 codes where `quantized_input` said so, [gate | up] where
        `gated_input` did, the norm's input where `normed_input` did) -> [..., output_size]."""
        return self.method.apply(self, x, self.bias)


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
