"""FP8 (e4m3) linear layers: `Fp8LinearMethod`, and the matmul each layer runs, chosen once at load.

After loading, a layer holds
    weight        [out, in] float8_e4m3fn      w = weight * weight_scale[:, None]
    weight_scale  [out] float32                one scale per output row. A tensor-strategy checkpoint's one
                                               scale per q/k/v (gate/up) tensor is kept on each of that
                                               shard's rows: exact, nothing is requantized.
    input_scale   [] float32                   static activations only: the largest of the packed shards'
                                               input_scale (they all quantize the same x)

and each step computes, for x [M, in] in the model dtype (`FP8_MATMULS` picks the kernel):
    x_q, x_scale = quantize_activations(x)          token: x_scale [M, 1] = max |x[m]| / 448, per step;
                                                    tensor: one [1, 1] for the step's x; static: input_scale
    y = (x_q @ weight^T) * x_scale * weight_scale   accumulated in fp32, rounded to the model dtype once;
                                                    then + bias

    rowwise      torch._scaled_mm, row-wise scales, bf16 out: CUDA sm_89+ with a bfloat16 model
    tensorwise   torch._scaled_mm into fp32, the scales applied after: CUDA sm_89+, float16 / float32 models
    emulated     the same product with `torch.mm` in fp32; the e4m3 weights are widened to fp32 once, at
                 load (exact: every e4m3 value is a float32 one). CPU and older GPUs: a correctness path,
                 not a speed path -- it holds 4 bytes a weight, as float32 does.
    dequantized  weights-only schemes (no input_activations): w in the model dtype, F.linear

`_scaled_mm` reads its second operand column-major: `weight.t()` of the row-major [out, in] weight is.
It needs `in` and `out` divisible by 16; a layer that is not runs emulated.

Block schemes (`sluice.engine.worker.layers.fp8_blocks`: a scale per [bn, bk] weight block, x quantized per
row and group of bk columns) keep the codes and block scales on CUDA sm_89+ and run `block_triton`
(`sluice.kernels.fp8_block_mm`: `quantize_fp8_groups`, then `fp8_block_mm`; steps of up to
SKINNY_MAX_ROWS rows, one row included (`block_runs_skinny`):
`sluice.kernels.fp8_skinny_mm.fp8_block_skinny_mm`, the same product swapped and split over K as
`fp8_skinny_mm`. Measured on an H200 (docs/perf/, run 12) with 128 x 128 blocks: at 2 rows the skinny launch
took 0.32-0.94x `fp8_block_mm`'s time on the qkv / o / gate_up / down of llama-3-8b and llama-3.2-1b;
`sluice.kernels.fp8_block_gemv` (quantization and product in one launch) took 0.85-4.4x `fp8_block_mm`'s
time at one row and longer than the skinny launch at two on every one of them, so no step takes the gemv);
elsewhere `block_emulated`
multiplies the blocks out to float32 at load and the groups' codes by their scales each step (a float32
rounding each, as compressed-tensors' decompression and fake quantization round them; the reference).

On rowwise and tensorwise, token and static activations are quantized by one Triton launch
(`sluice.kernels.fp8_quant.quantize_fp8`, bit for bit `quantize_activations`; x_scale [M, 1] either way,
contiguous: the row-wise scale_a as it is) instead of up to nine ATen kernels. A scheme with an
`activation_scale_ub` (fbgemm_fp8) caps each row's amax there: in that launch, in `fp8_gemv`, in the fused
quantization below (`scale_ub`) and in the emulation. Dynamic tensor activations (one amax over the whole
x) and the emulated path run `quantize_activations`.

One-row steps there run `sluice.kernels.fp8_gemv.fp8_gemv` instead on weights of at most GEMV_MAX_WEIGHT
elements (`runs_gemv`): the same quantization and product in one launch (the same codes and scales; the
fp32 sums in another order). Measured on an H100 (docs/perf/, fp8_linears_h100_*, runs 5-7) with the swept
tiles: at one row it took 0.52-0.71x `fp8_quant` + `_scaled_mm`'s time on the qkv / o / down of llama-3-8b
and llama-3.2-1b, whose 128-wide tiles leave most SMs idle there. On an H200 (run 12) `fp8_skinny_mm` at two
rows beat the gemv at one on every larger weight (llama-3-8b's qkv 12.8 us against 15.0, down 24.7 against
29.1, gate_up 34.6 against 51.1; llama-3.2-1b's gate_up 13.4 against 17.4) and lost on the smaller ones
(llama-3.2-1b's qkv 8.8 against 6.3, o 8.1 against 5.7), tying at 2^24 elements (llama-3-8b's o,
llama-3.2-1b's down): those larger weights take the skinny launch at one row too.

Where `fp8_quant` or `quantize_fp8_groups` would run, the kernel that made x may quantize it instead
(`quantized_input`, the seam of `sluice.engine.worker.layers.fp8_activations`): the decoders' RMSNorm before
qkv_proj / gate_up_proj and SiLU-and-mul before down_proj then hand `apply` an `Fp8Activations`, the same
codes and scales (per token, static, or per group of a block scheme's block_k columns).

With `fuse_norm` (`KernelConfig.fuse_norm_fp8`, off by default: untimed on a GPU) a one-row step takes
its input before the RMSNorm instead (`normed_input`, `NormedRows`): `fp8_normed_skinny_mm` (or on the
gemv's weights `fp8_normed_gemv`) normalizes the row (and adds the residual) and makes the same codes and
scale as each tile is loaded, one launch instead of the norm's and the product's (qkv_proj and
gate_up_proj: 64 launches a step fewer on llama-3-8b, 32 on llama-3.2-1b). With `fuse_silu`
(`KernelConfig.fuse_silu_fp8`, off by default, untimed) a one-row step takes down_proj's input before
SiLU-and-mul (`gated_input`, `GatedRows`): `fp8_gated_skinny_mm` (or `fp8_gated_gemv`) activates the
[gate | up] row and makes `silu_and_mul_fp8_quant`'s codes and scale as each tile is loaded, each program
first activating the whole row for its amax (32 launches a step fewer on llama-3-8b, 16 on llama-3.2-1b).

Every other step of up to SKINNY_MAX_ROWS rows runs `sluice.kernels.fp8_skinny_mm` on `fp8_quant`'s codes
(`runs_skinny`): the weight as the MMA's tall operand, K split over programs. On llama-3-8b's qkv / o / down
it took 0.76 / 0.72 / 0.65x `_scaled_mm`'s time at 16 rows and 1.02 / 0.85 / 0.78x at 64, and 0.93-0.99x on
gate_up (run 7); at 4 rows 0.71-0.79x the gemv's time at 2 rows on those three (run 6), hence the gemv at
one row only.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.loading.fp8_config import Fp8Scheme
from sluice.engine.worker.layers.fp8_activations import Fp8Activations, Fp8InputScheme
from sluice.engine.worker.layers.fp8_blocks import (
    dequantize_blocks,
    per_element_scales,
    quantize_activation_groups,
    quantize_weight_blocks,
    rank_block_scales,
)
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear_method import GatedRows, LinearMethod, NormedRows

if TYPE_CHECKING:
    from sluice.engine.worker.layers.linear import LinearBase

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_MIN_CUDA_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores
_MIN_SCALE = torch.finfo(torch.float32).tiny  # an all-zero row quantizes to zeros, not NaN
GEMV_MAX_ROWS = 1  # steps of at most this many rows run `fp8_gemv` (`runs_gemv`)
GEMV_MAX_WEIGHT = 1 << 24  # ... on weights of at most this many elements (the shard's)
SKINNY_MAX_ROWS = 64  # the other steps of at most this many rows run `fp8_skinny_mm` (`runs_skinny`)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (e4m3 codes [out, in], scale [out] float32): per output row, max |w| -> 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_activations(
    x: torch.Tensor,
    activations: str,
    input_scale: torch.Tensor | None = None,
    scale_ub: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, in] -> (x_q [M, in] e4m3, x_scale float32 [M, 1] (token) or [1, 1]), x ~ x_q * x_scale.
    `scale_ub` (token): each row's amax capped there first (FBGEMM's), the values past it saturating."""
    x = x.float()
    if activations == "token":
        amax = x.abs().amax(dim=1, keepdim=True)
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub)  # NaN stays NaN
        scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    elif activations == "tensor":
        scale = (x.abs().amax() / FP8_MAX).clamp(min=_MIN_SCALE).reshape(1, 1)
    else:  # static
        scale = input_scale.reshape(1, 1)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def runs_gemv(num_rows: int, out_features: int, in_features: int) -> bool:
    """Whether a step of `num_rows` through a weight [out_features, in_features] (its shard's) runs
    `fp8_gemv` rather than `fp8_quant` + `_scaled_mm` (on the layers that quantize in a kernel)."""
    return num_rows <= GEMV_MAX_ROWS and out_features * in_features <= GEMV_MAX_WEIGHT


def runs_skinny(num_rows: int, out_features: int, in_features: int) -> bool:
    """Whether a step of `num_rows` through a weight [out_features, in_features] runs `fp8_skinny_mm` on the
    codes of `fp8_quant` rather than `_scaled_mm` (on the layers that quantize in a kernel): up to
    SKINNY_MAX_ROWS, where not `runs_gemv`."""
    return num_rows <= SKINNY_MAX_ROWS and not runs_gemv(num_rows, out_features, in_features)


def block_runs_skinny(num_rows: int) -> bool:
    """Whether a step of `num_rows` through a block_triton layer runs `fp8_block_skinny_mm` rather than
    `fp8_block_mm`: up to SKINNY_MAX_ROWS, one row included."""
    return num_rows <= SKINNY_MAX_ROWS


def _rowwise(layer: LinearBase, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    scale_a = x_scale.expand(x_q.shape[0], 1).contiguous()  # [M, 1]: no copy of the kernel's [M, 1] scales
    scale_b = layer.weight_scale.view(1, -1)  # [1, out]
    return torch._scaled_mm(x_q, layer.weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def _tensorwise(layer: LinearBase, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    one = layer.unit_scale
    y = torch._scaled_mm(x_q, layer.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (y * x_scale * layer.weight_scale).to(layer.activation_dtype)


def _emulated(layer: LinearBase, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    y = torch.mm(x_q.float(), layer.weight.t())  # layer.weight: the e4m3 values widened to float32
    return (y * x_scale * layer.weight_scale).to(layer.activation_dtype)


def _block_emulated(layer: LinearBase, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    group = layer.method.scheme.block[1]
    x = x_q.float() * per_element_scales(x_scale, (1, group), x_q.shape)
    return torch.mm(x, layer.weight.t()).to(layer.activation_dtype)  # layer.weight: dequantized, float32


# (layer, x_q, x_scale) -> y [M, out] in the model dtype, before the bias; block_* for block schemes
FP8_MATMULS = {
    "rowwise": _rowwise,
    "tensorwise": _tensorwise,
    "emulated": _emulated,
    "block_emulated": _block_emulated,
}
SCALED_MM_MATMULS = ("rowwise", "tensorwise")
MATMULS = (*FP8_MATMULS, "block_triton", "dequantized")
KERNEL_QUANTIZED_ACTIVATIONS = ("token", "static")  # quantized by `sluice.kernels.fp8_quant` on those


def fp8_matmul_for(scheme: Fp8Scheme, kernels: KernelConfig, input_size: int, output_size: int) -> str:
    """The matmul a layer [output_size, input_size] of `scheme` runs under `kernels`: "dequantized" for
    weights only, `torch._scaled_mm` on CUDA sm_89+ ("rowwise" for bfloat16 models, else "tensorwise")
    when both sizes are multiples of 16, else "emulated"; block schemes "block_triton"
    (`sluice.kernels.fp8_block_mm`) on CUDA sm_89+, else "block_emulated"."""
    if scheme.activations == "none":
        return "dequantized"
    capability = kernels.cuda_capability or (0, 0)
    fp8_cores = kernels.device.type == "cuda" and capability >= FP8_MIN_CUDA_CAPABILITY
    if scheme.weight_strategy == "block":
        return "block_triton" if fp8_cores else "block_emulated"
    if fp8_cores and input_size % 16 == 0 and output_size % 16 == 0:
        return "rowwise" if kernels.dtype == torch.bfloat16 else "tensorwise"
    return "emulated"


class Fp8LinearMethod(LinearMethod):
    """`scheme` (from `sluice.engine.loading.fp8_config`) with the matmul `matmul` (a `FP8_MATMULS` key or
    "dequantized"). Serialized: the checkpoint fills weight (e4m3), weight_scale and, static, input_scale;
    else the float weight is quantized after loading, per channel or in the scheme's blocks."""

    def __init__(
        self, scheme: Fp8Scheme, matmul: str, fuse_norm: bool = False, fuse_silu: bool = False
    ) -> None:
        if matmul not in MATMULS:
            raise ValueError(f"matmul: must be one of {MATMULS}, got {matmul!r}")
        if matmul != "dequantized" and matmul.startswith("block_") != (scheme.weight_strategy == "block"):
            raise ValueError(f"matmul: {matmul!r} does not run weight_strategy {scheme.weight_strategy!r}")
        self.scheme = scheme
        self.matmul = matmul
        self.checkpoint_aliases = dict(scheme.aliases)
        self.scale_ub = scheme.activation_scale_ub  # fbgemm_fp8's cap on each row's amax, or None
        self.quantizes_in_kernel = (
            matmul in SCALED_MM_MATMULS and scheme.activations in KERNEL_QUANTIZED_ACTIVATIONS
        )
        # `KernelConfig.fuse_norm_fp8`: one-row steps take `NormedRows` (on the gemv or the skinny launch)
        self.fuse_norm = fuse_norm and self.quantizes_in_kernel
        # `KernelConfig.fuse_silu_fp8`: one-row steps take `GatedRows` (the same two launches)
        self.fuse_silu = fuse_silu and self.quantizes_in_kernel
        if self.quantizes_in_kernel:  # imported only when chosen: triton is not installed everywhere
            self._quantize_fp8 = import_module("sluice.kernels.fp8_quant").quantize_fp8
            gemv = import_module("sluice.kernels.fp8_gemv")
            self._fp8_gemv, self._fp8_normed_gemv = gemv.fp8_gemv, gemv.fp8_normed_gemv
            self._fp8_gated_gemv = gemv.fp8_gated_gemv
            skinny = import_module("sluice.kernels.fp8_skinny_mm")
            self._fp8_skinny_mm = skinny.fp8_skinny_mm
            self._fp8_normed_skinny_mm = skinny.fp8_normed_skinny_mm
            self._fp8_gated_skinny_mm = skinny.fp8_gated_skinny_mm
            self._gated_max_rows = skinny.GATED_MAX_ROWS
            norm = import_module("sluice.kernels.rms_norm")
            self._row_norm, self._norm_max_rows = norm.RowNorm, norm.NORM_MAX_ROWS
        if matmul == "block_triton":
            self._fp8_block_mm = import_module("sluice.kernels.fp8_block_mm")
            self._fp8_block_skinny_mm = import_module("sluice.kernels.fp8_skinny_mm").fp8_block_skinny_mm

    def create_weights(
        self,
        layer: LinearBase,
        input_size: int,
        output_sizes: tuple[int, ...],
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        output_size = sum(output_sizes)
        weight_dtype = FP8 if self.scheme.serialized else dtype
        layer.activation_dtype = dtype
        layer.weight = _parameter(torch.empty(output_size, input_size, dtype=weight_dtype))
        layer.bias = _parameter(torch.empty(output_size, dtype=dtype)) if bias else None
        if self.scheme.block is not None:
            block_scale_shape = self._block_scale_shape(layer)  # refuses shards that blocks cannot tile
        if self.scheme.serialized:
            scale_shape = (output_size,) if self.scheme.block is None else block_scale_shape
            setattr(layer, self.scheme.scale_name, _parameter(torch.empty(scale_shape, dtype=torch.float32)))
        if self.scheme.activations == "static":
            layer.input_scale = _parameter(torch.empty(len(output_sizes), dtype=torch.float32))

    def load_weight(
        self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard: int | None
    ) -> None:
        if param is layer.weight and self.scheme.serialized and loaded.dtype != FP8:
            raise ValueError(f"has dtype {loaded.dtype}, expected {FP8} (quantization_config: FP8 weights)")
        if param is not layer.weight and param is not layer.bias and not loaded.dtype.is_floating_point:
            raise ValueError(f"has dtype {loaded.dtype}, expected a float: a scale")  # e.g. exponent bytes
        if self.scheme.block is not None and param is getattr(layer, self.scheme.scale_name, None):
            self._load_block_scale(layer, param, loaded, shard)
        elif param is getattr(layer, "weight_scale", None):
            rows = param.data if shard is None else param.data[layer.shard_slice(shard)]
            expected = self._scale_shape(rows.shape[0])
            if loaded.numel() != _numel(expected):
                raise ValueError(
                    f"has shape {tuple(loaded.shape)}, expected {expected} "
                    f"(weights.strategy {self.scheme.weight_strategy})"
                )
            rows.copy_(loaded.reshape(-1).float().expand(rows.shape))
        elif param is getattr(layer, "input_scale", None):
            if loaded.numel() != 1:
                raise ValueError(f"has shape {tuple(loaded.shape)}, expected (1,): one static scale")
            param.data[shard or 0] = loaded.reshape(()).float()
        else:
            super().load_weight(layer, param, loaded, shard)

    def checkpoint_shape(self, layer: LinearBase, name: str, shard: int | None) -> tuple[int, ...]:
        rows = layer.output_size if shard is None else layer.output_sizes[shard]
        if name == self.scheme.scale_name and self.scheme.block is not None:
            return (-(-rows // self.scheme.block[0]), -(-layer.input_size // self.scheme.block[1]))
        if name == "weight_scale":
            return self._scale_shape(rows)
        if name == "input_scale":
            return (1,)
        return super().checkpoint_shape(layer, name, shard)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if not self.scheme.serialized:  # per channel, or in blocks (`--fp8-weight-block`)
            block = self.scheme.block
            weight = layer.weight.data
            codes, scale = quantize_weight(weight) if block is None else quantize_weight_blocks(weight, block)
            layer.weight, layer.weight_scale = _parameter(codes), _parameter(scale)
        if self.scheme.scale_name != "weight_scale":  # weight_scale_inv: the same product, by its name
            layer.weight_scale = getattr(layer, self.scheme.scale_name)
            delattr(layer, self.scheme.scale_name)
        _check_scales("weight_scale", layer.weight_scale.data)
        if self.scheme.block is not None:
            self._block_layout(layer)
            if self.matmul == "block_triton":
                layer.input_scheme = Fp8InputScheme(group_size=self.scheme.block[1])
            return
        if self.scheme.activations == "static":
            _check_scales("input_scale", layer.input_scale.data)
            layer.input_scale = _parameter(layer.input_scale.data.amax())
        if self.matmul == "emulated":
            layer.weight.data = layer.weight.data.float()
        elif self.matmul == "dequantized":
            dequantized = layer.weight.data.float() * layer.weight_scale.data[:, None]
            layer.weight.data = dequantized.to(layer.activation_dtype)
        elif self.matmul == "tensorwise":
            layer.unit_scale = torch.ones((), dtype=torch.float32, device=layer.weight.device)
        if self.quantizes_in_kernel:
            layer.input_scheme = Fp8InputScheme(getattr(layer, "input_scale", None), scale_ub=self.scale_ub)

    def quantized_input(self, layer: LinearBase, num_rows: int) -> Fp8InputScheme | None:
        """The scheme in which a step of `num_rows` may hand this layer its input already quantized (an
        `Fp8Activations`): where `apply` would run a quantization launch on x, i.e. `fp8_quant` on
        `_scaled_mm` with token or static activations off the steps of `fp8_gemv`, or
        `quantize_fp8_groups` on block_triton (the scheme's group_size), every step. Else None."""
        if self.matmul == "block_triton":
            return layer.input_scheme
        if not self.quantizes_in_kernel or runs_gemv(num_rows, *layer.weight.shape):
            return None
        return layer.input_scheme

    def normed_input(self, layer: LinearBase, num_rows: int) -> bool:
        """With `fuse_norm`, a step of one row (NORM_MAX_ROWS) takes its input as `NormedRows`: its launch
        normalizes the row and quantizes it (`fp8_normed_gemv` where `runs_gemv`, else
        `fp8_normed_skinny_mm`)."""
        return self.fuse_norm and 0 < num_rows <= self._norm_max_rows

    def gated_input(self, layer: LinearBase, num_rows: int) -> bool:
        """With `fuse_silu`, a step of one row (GATED_MAX_ROWS) takes its input as `GatedRows`: its launch
        activates [gate | up] and quantizes it (`fp8_gated_gemv` where `runs_gemv`, else
        `fp8_gated_skinny_mm`)."""
        return self.fuse_silu and 0 < num_rows <= self._gated_max_rows

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor | Fp8Activations | NormedRows | GatedRows,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if isinstance(x, Fp8Activations):  # quantized by the kernel that made it ([M, in] only)
            y = self._matmul(layer, x.x_q, x.x_scale, x.dtype)
            return y if bias is None else y + bias
        if isinstance(x, (NormedRows, GatedRows)):  # one row made into codes in the product's loads
            y = self._apply_row(layer, x)
            return y if bias is None else y + bias
        if self.matmul == "dequantized":
            return F.linear(x, layer.weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        input_scale = getattr(layer, "input_scale", None)
        if self.quantizes_in_kernel and runs_gemv(rows.shape[0], *layer.weight.shape):
            y = self._fp8_gemv(rows, layer.weight, layer.weight_scale, input_scale, scale_ub=self.scale_ub)
        else:
            x_q, x_scale = self.quantize(rows, input_scale)
            y = self._matmul(layer, x_q, x_scale, rows.dtype)
        y = y.view(*x.shape[:-1], -1)
        return y if bias is None else y + bias

    def _apply_row(self, layer: LinearBase, x: NormedRows | GatedRows) -> torch.Tensor:
        """y [1, out] before the bias, the row normed (`normed_input`) or activated (`gated_input`) and
        quantized in the product's loads: on the gemv's launch where `runs_gemv`, else the skinny one."""
        input_scale = getattr(layer, "input_scale", None)
        rows = x.x if isinstance(x, NormedRows) else x.gate_up
        gemv = runs_gemv(rows.shape[0], *layer.weight.shape)
        if isinstance(x, NormedRows):
            norm = self._row_norm(x.norm_weight, x.eps, x.residual, x.residual_out)
            launch = self._fp8_normed_gemv if gemv else self._fp8_normed_skinny_mm
            return launch(rows, norm, layer.weight, layer.weight_scale, input_scale, self.scale_ub)
        launch = self._fp8_gated_gemv if gemv else self._fp8_gated_skinny_mm
        return launch(rows, layer.weight, layer.weight_scale, input_scale, self.scale_ub)

    def _matmul(
        self, layer: LinearBase, x_q: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """y [M, out] in `dtype`, before the bias, from x's codes [M, in] and scales."""
        if self.quantizes_in_kernel and runs_skinny(x_q.shape[0], *layer.weight.shape):
            return self._fp8_skinny_mm(x_q, x_scale, layer.weight, layer.weight_scale, dtype)
        if self.matmul == "block_triton":
            skinny = block_runs_skinny(x_q.shape[0])
            block_mm = self._fp8_block_skinny_mm if skinny else self._fp8_block_mm.fp8_block_mm
            return block_mm(x_q, x_scale, layer.weight, layer.weight_scale, self.scheme.block, dtype)
        return FP8_MATMULS[self.matmul](layer, x_q, x_scale)

    def quantize(
        self, x: torch.Tensor, input_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, in] -> (x_q, x_scale) for the matmul: the Triton kernel on `_scaled_mm` (token, static)
        or on "block_triton" (group), else `quantize_activations` / `quantize_activation_groups`; the
        same bits either way."""
        if self.quantizes_in_kernel:
            return self._quantize_fp8(x, input_scale, self.scale_ub)
        if self.matmul == "block_triton":
            return self._fp8_block_mm.quantize_fp8_groups(x, self.scheme.block[1])
        if self.scheme.activations == "group":
            return quantize_activation_groups(x, self.scheme.block[1])
        return quantize_activations(x, self.scheme.activations, input_scale, self.scale_ub)

    def _block_scale_shape(self, layer: LinearBase) -> tuple[int, int]:
        """A block scheme's weight_scale [cdiv(out, bn), cdiv(in, bk)]. A packed layer's shards stack their
        block rows, so every shard but the last must fill whole blocks."""
        block_n = self.scheme.block[0]
        if any(rows % block_n for rows in layer.output_sizes[:-1]):
            where = "quantization_config" if self.scheme.serialized else "fp8_weight_block"
            raise ValueError(
                f"{where}: weight blocks of {block_n} rows do not tile the packed shards of "
                f"{layer.output_sizes} rows (each shard but the last must be a multiple of {block_n})"
            )
        return self.checkpoint_shape(layer, self.scheme.scale_name, None)

    def _load_block_scale(
        self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard: int | None
    ) -> None:
        """Checkpoint block scales (this rank's part of them) into the rows of `shard`'s blocks."""
        block_n, block_k = self.scheme.block
        loaded = rank_block_scales(layer, loaded, shard, self.scheme.block)
        first = 0 if shard is None else sum(layer.output_sizes[:shard]) // block_n
        expected = self.checkpoint_shape(layer, self.scheme.scale_name, shard)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"has shape {tuple(loaded.shape)}, expected {expected} (weight blocks {block_n} x {block_k})"
            )
        param.data[first : first + expected[0]].copy_(loaded.float())

    def _block_layout(self, layer: LinearBase) -> None:
        """After loading a block scheme: block_triton keeps the e4m3 codes and their block scales; the others
        multiply them out, to float32 (block_emulated: codes * scale, one float32 rounding a weight) or the
        model dtype (dequantized)."""
        if self.matmul == "block_triton":
            return
        dequantized = dequantize_blocks(layer.weight.data, layer.weight_scale.data, self.scheme.block)
        if self.matmul == "dequantized":
            dequantized = dequantized.to(layer.activation_dtype)
        layer.weight.data = dequantized

    def _scale_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, 1) if self.scheme.weight_strategy == "channel" else (1,)

    def __repr__(self) -> str:
        fused = "".join(f", {name}=True" for name in ("fuse_norm", "fuse_silu") if getattr(self, name))
        return f"{type(self).__name__}({self.scheme}, matmul={self.matmul!r}{fused})"


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _check_scales(name: str, scales: torch.Tensor) -> None:
    if not bool(torch.isfinite(scales).all() and (scales > 0).all()):
        raise ValueError(f"weights: a {name} is not a positive finite number ({scales.min().item()})")
