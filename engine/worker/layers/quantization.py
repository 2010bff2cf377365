"""Weight-only quantization of linear layers on CPU (`--quantization int4|int8`), with torch's own kernels.

    int4   groups of INT4_GROUP_SIZE input columns, asymmetric: w = (q - 8) * scale + zero, q in 0..15
           (`aten._weight_int4pack_mm_for_cpu`); a GGUF's Q4_1 blocks (w = d * q + m over 32 columns)
           land on the same codes: scale = d, zero = m + 8 d.
    int8   one symmetric scale per output row: w = q * scale, q in -127..127 (`aten._weight_int8pack_mm`).

Both kernels are fast only with bfloat16 activations (with float32 ones they are a slow reference path), so
a quantized matmul rounds x, the scales and the result to bf16 once each. They pay only on small steps,
up to MAX_QUANTIZED_ROWS[method] rows; larger steps use the float32 weight, packed for the C++ kernel
(`sluice.kernels.cpu_packed_linear`), which is then faster, so a quantized layer holds both
(`CpuQuantizedLinearMethod`).

`linear_method_for` is where a layer's `LinearMethod` is chosen, from the `KernelConfig`: FP8 (a checkpoint's
compressed-tensors or quant_method fp8 config, or `--quantization fp8`) takes
`sluice.engine.worker.layers.fp8_linear`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sluice.engine.worker.layers.fp8_linear import Fp8LinearMethod, fp8_matmul_for
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear_method import (
    CpuPackedLinearMethod,
    LinearMethod,
    SkinnyLinearMethod,
    UnquantizedLinearMethod,
)
from sluice.kernels.cpu_decoder_stack import QuantizedArgs
from sluice.kernels.cpu_packed_linear import EXTENSION as CPU_PACKED_LINEAR

if TYPE_CHECKING:
    from sluice.engine.worker.layers.linear import LinearBase

CPU_QUANTIZATIONS = ("int4", "int8")
INT4_GROUP_SIZE = 32
INT4_OUTPUT_MULTIPLE = 16  # `_convert_weight_to_int4pack_for_cpu` packs output rows in 16s
# `_weight_int8pack_mm` on CPU steps along the input 16 columns at a time with AVX-512 (8 with AVX2), with
# aligned loads and no remainder loop, and checks nothing: another input_size read past each row (garbage
# outputs, or SIGSEGV). 16 serves every host.
INT8_INPUT_MULTIPLE = 16
# Rows at or below which a quantized matmul beats the packed float32 kernel, measured on SmolLM2-135M's
# shapes on 2 cores (docs/BENCHMARKS.md, "Figures behind the code"). torch's int4 kernel gains more from
# AVX-512 than the packed kernel does, so its limit depends on the CPU.
_AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
MAX_QUANTIZED_ROWS = {"int4": 16 if _AVX512 else 4, "int8": 4}
_ACTIVATIONS = torch.bfloat16


class Int4Weight:
    """Group-wise asymmetric int4, packed for the CPU kernel. input_size must be a multiple of 32,
    output_size of 16."""

    max_rows = MAX_QUANTIZED_ROWS["int4"]  # larger steps use the float32 weight

    def __init__(self, weight: torch.Tensor) -> None:
        out_features, in_features = weight.shape
        groups = weight.float().reshape(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low) / scale).round().clamp(0, 15)
        self.codes = codes.to(torch.int32).reshape(out_features, in_features)
        self.scale, self.low = scale, low
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes, 1)
        zero = low + 8 * scale
        # [in_features // group, out_features, 2]: (scale, zero) per group and output row
        self.scales_and_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(_ACTIVATIONS)

    def kernel_args(self) -> QuantizedArgs:
        """What the C++ decoder stack runs `matmul` from: (packed, scales_and_zeros, group size, max_rows)."""
        return self.packed, self.scales_and_zeros, INT4_GROUP_SIZE, self.max_rows

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(_ACTIVATIONS), self.packed, INT4_GROUP_SIZE, self.scales_and_zeros
        ).to(x.dtype)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        groups = self.codes.reshape(*self.scale.shape[:2], INT4_GROUP_SIZE)
        return (groups * self.scale + self.low).reshape(self.codes.shape)


class Int8Weight:
    """Per-output-row symmetric int8. input_size must be a multiple of 16."""

    max_rows = MAX_QUANTIZED_ROWS["int8"]  # larger steps use the float32 weight

    def __init__(self, weight: torch.Tensor) -> None:
        weight = weight.float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.codes = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale
        self.scales = scale.to(_ACTIVATIONS)

    def kernel_args(self) -> QuantizedArgs:
        """What the C++ decoder stack runs `matmul` from: (codes, scales, 0 (no groups), max_rows)."""
        return self.codes, self.scales, 0, self.max_rows

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(_ACTIVATIONS), self.codes, self.scales).to(x.dtype)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale[:, None]


QuantizedWeight = Int4Weight | Int8Weight  # weight [out, in] -> matmul(x, bias) = x W^T (+ b)


def unsupported_reason(method: str, input_size: int, output_size: int, device: torch.device) -> str | None:
    """None when `method` can quantize a weight [output_size, input_size] on `device`, else why not."""
    if device.type != "cpu":
        return f"runs on cpu, the weight is on {device.type}"
    if method == "int4" and input_size % INT4_GROUP_SIZE:
        return f"needs input_size divisible by {INT4_GROUP_SIZE}, got {input_size}"
    if method == "int4" and output_size % INT4_OUTPUT_MULTIPLE:
        return f"needs output_size divisible by {INT4_OUTPUT_MULTIPLE}, got {output_size}"
    if method == "int8" and input_size % INT8_INPUT_MULTIPLE:
        return f"needs input_size divisible by {INT8_INPUT_MULTIPLE}, got {input_size}"
    return None


def quantize_weight(method: str, weight: torch.Tensor) -> QuantizedWeight:
    """`weight` [output_size, input_size] quantized by `method` ("int4" or "int8")."""
    if method not in CPU_QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {CPU_QUANTIZATIONS}, got {method!r}")
    return Int4Weight(weight) if method == "int4" else Int8Weight(weight)


class CpuQuantizedLinearMethod(LinearMethod):
    """The float weight (`float_method`: packed, or column-major) plus `layer.quantized`, its int4 / int8
    copy, which runs steps of up to `layer.quantized.max_rows` rows."""

    def __init__(self, quantization: str, float_method: UnquantizedLinearMethod) -> None:
        if quantization not in CPU_QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {CPU_QUANTIZATIONS}, got {quantization!r}")
        self.quantization = quantization
        self.float_method = float_method

    def create_weights(
        self,
        layer: LinearBase,
        input_size: int,
        output_sizes: tuple[int, ...],
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        self.float_method.create_weights(layer, input_size, output_sizes, bias, dtype)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        layer.quantized = quantize_weight(self.quantization, layer.weight.data)  # before the packing
        self.float_method.process_weights_after_loading(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= layer.quantized.max_rows:
            return layer.quantized.matmul(x, bias)
        return self.float_method.apply(layer, x, bias)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.quantization!r}, {self.float_method!r})"


def float_linear_method(kernels: KernelConfig) -> UnquantizedLinearMethod:
    """The method of a layer in the model dtype under `kernels`: Sluice's skinny launch where asked, the
    C++ panels for float32 on CPU where built, else `F.linear` (column-major weights on CPU)."""
    if kernels.skinny_linears:
        return SkinnyLinearMethod()
    if kernels.runs_cpu_kernel(CPU_PACKED_LINEAR):
        return CpuPackedLinearMethod()
    return UnquantizedLinearMethod(column_major=kernels.device.type == "cpu")


def linear_method_for(prefix: str, layer: LinearBase, kernels: KernelConfig) -> LinearMethod:
    """The method of linear layer `layer` (module name `prefix`, e.g. "model.layers.0.mlp.down_proj") under
    `kernels`. Under int4, lm_head takes int8: its error reaches the logits directly, and it is a tenth of the
    weights. Under fp8, the layers its `Fp8Config` leaves out take the float method. Raises ValueError
    naming `quantization` when the layer cannot be quantized so."""
    float_method = float_linear_method(kernels)
    if kernels.fp8 is not None:
        scheme = kernels.fp8.scheme_for(prefix)
        if scheme is None:
            return float_method
        matmul = fp8_matmul_for(scheme, kernels, layer.input_size, layer.output_size)
        return Fp8LinearMethod(
            scheme, matmul, fuse_norm=kernels.fuse_norm_fp8, fuse_silu=kernels.fuse_silu_fp8
        )
    method = kernels.quantization
    if method is None:
        return float_method
    if method == "int4" and prefix == "lm_head":
        method = "int8"
    if reason := unsupported_reason(method, layer.input_size, layer.output_size, kernels.device):
        raise ValueError(f"quantization: {method} {reason}")
    return CpuQuantizedLinearMethod(method, float_method)
