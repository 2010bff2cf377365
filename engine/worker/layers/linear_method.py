"""How a linear layer holds and applies its weight: one `LinearMethod` per layer, chosen at load
(`sluice.engine.worker.layers.quantization.linear_method_for`), vLLM's `quant_method`.

    create_weights(layer, ...)            before loading: register the parameters the checkpoint names
                                          (weight, bias; a quantized checkpoint's weight_scale, ...)
    layer.weight_loader(param, t, shard)  the layer places each checkpoint tensor, by shard; the rows of
                                          a shard are `load_weight`'s (a per-tensor scale fills them all)
    process_weights_after_loading(layer)  once, after loading: the layout the kernel reads
    apply(layer, x, bias)                 every step: x [..., input_size] -> [..., output_size]

State a method makes lives on the layer (`layer.packed`, `layer.quantized`), so one method object could serve
many layers. `apply` takes the bias apart from the layer so that a row-parallel layer can add it on one rank.

    UnquantizedLinearMethod   F.linear. On CPU (column_major) the weight is stored column-major: `weight.t()`
                              is a contiguous [input_size, output_size] matrix, so `F.linear` hands MKL an
                              untransposed operand (its sgemm on a transposed one is slower at a few
                              rows: docs/BENCHMARKS.md, "Figures behind the code").
    CpuPackedLinearMethod     float32 on CPU: the weight in column panels for the C++ kernel in
                              `kernels/cpu_packed_linear.h` (`packed` [num_panels, input_size, panel width];
                              each matmul streams them front to back; faster than MKL's sgemm on
                              decode-sized steps, docs/BENCHMARKS.md). The packed tensor replaces the
                              weight's data, so memory stays flat, except for a weight tied to the
                              embeddings, which keeps its rows for the lookups and gets a packed copy.
    SkinnyLinearMethod        the same weight; steps of up to 64 rows run Sluice's Triton split-K launch
                              (`sluice.kernels.skinny_mm`) instead of cuBLAS (`KernelConfig.skinny_linears`,
                              off by default: untimed on a GPU); as a SiLU-gated MLP's down_proj it takes
                              the [gate | up] rows and activates them in its own loads (`gated_input`), as
                              the linear after an RMSNorm it takes one row un-normed and normalizes it in
                              its own loads (`normed_input`)
    CpuQuantizedLinearMethod  `sluice.engine.worker.layers.quantization`: int4 / int8 on CPU
    Fp8LinearMethod           `sluice.engine.worker.layers.fp8_linear`: e4m3 weights, FP8 checkpoints
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import import_module
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels.cpu_packed_linear import pack_weight, packed_linear_prechecked

if TYPE_CHECKING:
    from sluice.engine.worker.layers.fp8_activations import Fp8InputScheme
    from sluice.engine.worker.layers.linear import LinearBase


@dataclass(frozen=True)
class GatedRows:
    """A linear's input handed over unactivated: gate_up [T, 2 * d] = [gate | up], the input being
    silu(gate) * up [T, d], made by the linear's own launch (where `LinearMethod.gated_input` said so)."""

    gate_up: torch.Tensor


@dataclass(frozen=True)
class NormedRows:
    """A linear's input handed over before its RMSNorm: x [T, d] (+ residual), the input being
    `RMSNorm(x + residual)`, made by the linear's own launch (where `LinearMethod.normed_input` said so),
    which also writes x + residual to residual_out (None without a residual)."""

    x: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None
    residual_out: torch.Tensor | None


class LinearMethod:
    """The interface (see the module docstring). Sizes are the layer's own: a tensor-parallel layer passes
    its rank's part. `checkpoint_aliases`: other names a checkpoint may give a parameter (name -> parameter;
    the loader reads either, never both)."""

    checkpoint_aliases: Mapping[str, str] = MappingProxyType({})

    def create_weights(
        self,
        layer: LinearBase,
        input_size: int,
        output_sizes: tuple[int, ...],
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        """Register on `layer` the parameters a checkpoint fills, on the current default device (meta while a
        model is built): at least `weight`, and `bias` [sum(output_sizes)] (None without)."""
        raise NotImplementedError

    def load_weight(
        self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard: int | None
    ) -> None:
        """Copy checkpoint tensor `loaded` into `param` (all of it, or shard `shard`'s rows), casting to the
        parameter's dtype. Raises ValueError on a shape mismatch."""
        target = param.data if shard is None else param.data[layer.shard_slice(shard)]
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded)

    def checkpoint_shape(self, layer: LinearBase, name: str, shard: int | None) -> tuple[int, ...]:
        """The shape of the checkpoint tensor that fills parameter `name` (or its shard `shard`)."""
        shape = tuple(getattr(layer, name).shape)
        return shape if shard is None else (layer.output_sizes[shard], *shape[1:])

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Run once after every checkpoint tensor is in: make the layout `apply` reads."""

    def quantized_input(self, layer: LinearBase, num_rows: int) -> Fp8InputScheme | None:
        """How the kernel before this layer may quantize its input for a step of `num_rows` rows, handing
        `apply` an `Fp8Activations` (`sluice.engine.worker.layers.fp8_activations`); None (every method
        but FP8's): `apply` takes the float x."""
        return None

    def gated_input(self, layer: LinearBase, num_rows: int) -> bool:
        """Whether `apply` takes a step of `num_rows` rows as `GatedRows` (SiLU-and-mul in its launch)."""
        return False

    def normed_input(self, layer: LinearBase, num_rows: int) -> bool:
        """Whether `apply` takes a step of `num_rows` rows as `NormedRows` (the RMSNorm in its launch)."""
        return False

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """weight [output_size, input_size] in the model dtype; y = F.linear(x, weight, bias)."""

    def __init__(self, column_major: bool = False) -> None:
        self.column_major = column_major

    def create_weights(
        self,
        layer: LinearBase,
        input_size: int,
        output_sizes: tuple[int, ...],
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        output_size = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        layer.bias = (
            nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None
        )

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if self.column_major:
            # In place on the parameter, so a tied embedding shares the layout (lookups read strided rows).
            layer.weight.data = layer.weight.data.t().contiguous().t()

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(column_major={self.column_major})"


class SkinnyLinearMethod(UnquantizedLinearMethod):
    """weight [output_size, input_size] row-major in the model dtype; x of up to the kernel's MAX_ROWS rows
    (64) runs `sluice.kernels.skinny_mm.skinny_mm` (then + bias), more rows `F.linear`; `GatedRows` of up
    to MAX_ROWS rows its gated launch (`gated_input`), `NormedRows` of NORM_MAX_ROWS (one) its launch with
    the norm (`normed_input`). Where the Triton kernels run (`KernelConfig.skinny_linears` checks)."""

    def __init__(self) -> None:
        super().__init__(column_major=False)
        # imported only when chosen: triton is optional
        module, norm = import_module("sluice.kernels.skinny_mm"), import_module("sluice.kernels.rms_norm")
        self._skinny_mm, self._row_norm = module.skinny_mm, norm.RowNorm
        self.max_rows, self.norm_max_rows = module.MAX_ROWS, norm.NORM_MAX_ROWS

    def gated_input(self, layer: LinearBase, num_rows: int) -> bool:
        return num_rows <= self.max_rows

    def normed_input(self, layer: LinearBase, num_rows: int) -> bool:
        return num_rows <= self.norm_max_rows

    def apply(
        self, layer: LinearBase, x: torch.Tensor | GatedRows | NormedRows, bias: torch.Tensor | None
    ) -> torch.Tensor:
        gated, norm = isinstance(x, GatedRows), None
        if gated:
            x = x.gate_up
        elif isinstance(x, NormedRows):  # the kernel checks its rows (NORM_MAX_ROWS)
            x, norm = x.x, self._row_norm(x.norm_weight, x.eps, x.residual, x.residual_out)
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_rows:
            if gated or norm is not None:  # `gated_input` / `normed_input` said no
                kind = "gated" if gated else "normed"
                raise ValueError(f"x: at most {self.max_rows} {kind} rows, got {rows.shape[0]}")
            return F.linear(x, layer.weight, bias)
        y = self._skinny_mm(rows, layer.weight, gated=gated, norm=norm)
        y = y.view(*x.shape[:-1], layer.weight.shape[0])
        return y if bias is None else y + bias

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CpuPackedLinearMethod(UnquantizedLinearMethod):
    """float32 on CPU, the C++ kernel `sluice.kernels.cpu_packed_linear`. After loading, `layer.packed` holds
    the panels [num_panels, input_size, panel width]; an untied layer's `weight` is that same tensor."""

    def __init__(self) -> None:
        super().__init__(column_major=False)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        layer.packed = pack_weight(layer.weight.data)
        if not layer.weight_is_tied:
            layer.weight.data = layer.packed

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return packed_linear_prechecked(x, layer.packed, layer.output_size, bias)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
