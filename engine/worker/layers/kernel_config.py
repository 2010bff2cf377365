"""Which kernels run a model's layers: decided once, by the runner, before the model is built.

    kernels = KernelConfig.for_model(device, dtype, backend, quantization, ...)   # checks availability
    model = model_class(arch, kernels)      # every op, linear and attention layer chooses from it, once

The choice reaches the layers through this one frozen object, handed to the model constructor, which hands it
to `CausalLM.materialize`: that walks the built (meta) model once, giving each linear its `LinearMethod` and
each `CustomOp` its implementation. No constructor below the model class takes it, and nothing looks at a
tensor's device or dtype per call. Why an object and not a walk after loading: a linear's method decides
which parameters it has (an FP8 checkpoint's `weight_scale`), so it must be known before the weights are
created; and a tensor-parallel layer sizes its rank's part at that same moment (`tensor_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sluice.engine.config import QUANTIZATIONS
from sluice.engine.distributed.group import TensorParallelGroup
from sluice.engine.loading.fp8_config import Fp8Config
from sluice.engine.worker.attention.backend import AttentionBackend
from sluice.engine.worker.attention.selector import TRITON_BACKENDS
from sluice.kernels.cpu_extension import cpu_extension_available
from sluice.kernels.cpu_packed_linear import EXTENSION as CPU_PACKED_LINEAR
from sluice.kernels.cpu_rms_norm import EXTENSION as CPU_RMS_NORM
from sluice.kernels.cpu_rotary import EXTENSION as CPU_ROTARY
from sluice.kernels.cpu_silu_and_mul import EXTENSION as CPU_SILU_AND_MUL

# The C++ kernels the layers call one at a time (the attention backend and the decoder stack check their own).
CPU_LAYER_KERNELS = (CPU_PACKED_LINEAR, CPU_RMS_NORM, CPU_ROTARY, CPU_SILU_AND_MUL)


@dataclass(frozen=True)
class KernelConfig:
    """device, dtype: where and in what the model runs.
    attention_backend: the attention layers' backend (None: a model built only to read its shapes).
    cpu_kernels: the C++ kernels (`CPU_LAYER_KERNELS` names) that are built and may run: float32 on cpu only.
    quantization: quantization of the linears ("int4", "int8": weight-only on cpu; "fp8"), or None.
    fp8: with quantization "fp8", each linear's FP8 scheme (`sluice.engine.loading.fp8_config`).
    kv_cache_dtype: the KV cache's dtype when it is not `dtype` (torch.float8_e4m3fn), else None.
    cuda_capability: the CUDA device's (major, minor) compute capability, None off CUDA.
    tensor_parallel: this rank's group; the parallel layers hold its part of the weights and call its
        collectives (`sluice.engine.worker.layers.parallel_linear`). One process: rank 0 of 1.
    fuse_rotary_store: rotate q, k and store K/V in one kernel where the backend can (Triton); False runs
        them as two (the GPU benchmark's before/after).
    fuse_fp8_quant_norm, fuse_fp8_quant_silu: where an FP8 linear would quantize its input with its own
        launch, the Triton RMSNorm (before qkv_proj, gate_up_proj) or SiLU-and-mul (before down_proj) writes
        the codes instead (`sluice.engine.worker.layers.fp8_activations`); False leaves the launch to the
        linear (per token or static on `_scaled_mm`, per group of block_k columns on block FP8's
        `block_triton`). fuse_fp8_quant_norm_groups: the norm's fusion for block FP8's groups too (off).
        On an H200 (docs/perf/README.md, run 12; fused / unfused launch times at 1-256 rows): the norm per
        token 0.85-0.98 on llama-3-8b, 0.76-0.83 on llama-3.2-1b; per group of 128, 2.1-4.2 and 1.1-2.0
        (hence off); the one-pass SiLU-and-mul per token 0.91-1.09 and 0.82-0.89, per group 0.64-0.85 and
        0.62-0.76 (run 11's two-pass kernel took 2x the unfused launches; off until run 12).
    skinny_linears: the float linears run steps of up to 64 rows on `sluice.kernels.skinny_mm` (the
        `SkinnyLinearMethod`) instead of cuBLAS; needs the Triton kernels (`triton`). Off: untimed.
    fuse_silu_skinny: with skinny_linears, SiLU-and-mul runs inside down_proj's launch (`GatedRows`: the
        same bits, one launch fewer a layer); False: its own launch (the GPU check's `pdl` section's
        "SiLU-and-mul in its own launch" row).
    fuse_norm_skinny: with skinny_linears, a one-row step's RMSNorm (and residual add) before qkv_proj and
        gate_up_proj runs inside their launch (`NormedRows`; the row's sum of squares in each program);
        False: its own launch (the `pdl` section's "RMSNorm in its own launch" row).
    fuse_norm_fp8: in an FP8 model, a one-row step's RMSNorm (and residual add) before qkv_proj and
        gate_up_proj runs inside their launch (`NormedRows`: `fp8_normed_skinny_mm`, or `fp8_normed_gemv`
        on the gemv's weights), which normalizes and quantizes each tile as it loads it; False (the
        default, untimed on a GPU): the norm's own launch (writing the codes where `fuse_fp8_quant_norm`
        says so). Needs the Triton kernels and FP8 linears.
    fuse_silu_fp8: in an FP8 model, a one-row step's SiLU-and-mul before down_proj runs inside its launch
        (`GatedRows`: `fp8_gated_skinny_mm`, or `fp8_gated_gemv` on the gemv's weights), which activates
        and quantizes each tile as it loads it, each program first activating the whole row for its amax;
        False (the default, untimed on a GPU): SiLU-and-mul's own launch. Needs what fuse_norm_fp8 needs.
    """

    device: torch.device
    dtype: torch.dtype
    attention_backend: AttentionBackend | None = None
    cpu_kernels: frozenset[str] = frozenset()
    quantization: str | None = None
    fp8: Fp8Config | None = None
    kv_cache_dtype: torch.dtype | None = None
    cuda_capability: tuple[int, int] | None = None
    tensor_parallel: TensorParallelGroup = field(default_factory=TensorParallelGroup.single)
    fuse_rotary_store: bool = True
    fuse_fp8_quant_norm: bool = True
    fuse_fp8_quant_norm_groups: bool = False
    fuse_fp8_quant_silu: bool = True
    skinny_linears: bool = False
    fuse_silu_skinny: bool = True
    fuse_norm_skinny: bool = True
    fuse_norm_fp8: bool = False
    fuse_silu_fp8: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.device, torch.device):
            raise ValueError(f"device: must be a torch.device, got {self.device!r}")
        unknown = self.cpu_kernels - set(CPU_LAYER_KERNELS)
        if unknown:
            raise ValueError(f"cpu_kernels: unknown {sorted(unknown)}; known: {', '.join(CPU_LAYER_KERNELS)}")
        if self.cpu_kernels and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError(
                f"cpu_kernels: the C++ kernels run float32 on cpu, not {self.dtype} on {self.device}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if (self.quantization == "fp8") != (self.fp8 is not None):
            raise ValueError(f"fp8: an Fp8Config goes with quantization 'fp8', got {self.quantization!r}")
        if self.kv_cache_dtype not in (None, torch.float8_e4m3fn):
            raise ValueError(f"kv_cache_dtype: None or torch.float8_e4m3fn, got {self.kv_cache_dtype}")
        if self.skinny_linears and not self.triton:
            backend = getattr(self.attention_backend, "name", None)
            raise ValueError(
                "skinny_linears: needs the Triton kernels (a Triton attention backend: a CUDA device, or "
                f"TRITON_INTERPRET=1 on cpu), got the {backend!r} backend"
            )
        for name in ("fuse_norm_fp8", "fuse_silu_fp8"):
            if getattr(self, name) and (self.fp8 is None or not self.triton):
                raise ValueError(
                    f"{name}: needs FP8 linears (--quantization fp8 or an FP8 checkpoint) on the "
                    f"Triton kernels, got quantization {self.quantization!r} on the "
                    f"{getattr(self.attention_backend, 'name', None)!r} backend"
                )

    @classmethod
    def for_model(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: AttentionBackend | None,
        quantization: str | None = None,
        *,
        fp8: Fp8Config | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        tensor_parallel: TensorParallelGroup | None = None,
        skinny_linears: bool = False,
        fuse_norm_fp8: bool = False,
        fuse_silu_fp8: bool = False,
    ) -> KernelConfig:
        """The config for a model on `device` in `dtype`: the C++ kernels are checked (built if needed) here,
        once; a kernel that cannot be built is logged and its ops run plain PyTorch. A CUDA device's
        compute capability is read here, once."""
        cpu_kernels: frozenset[str] = frozenset()
        if device.type == "cpu" and dtype == torch.float32:
            cpu_kernels = frozenset(name for name in CPU_LAYER_KERNELS if cpu_extension_available(name))
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        tensor_parallel = tensor_parallel or TensorParallelGroup.single()
        return cls(
            device,
            dtype,
            attention_backend,
            cpu_kernels,
            quantization,
            fp8,
            kv_cache_dtype,
            capability,
            tensor_parallel,
            skinny_linears=skinny_linears,
            fuse_norm_fp8=fuse_norm_fp8,
            fuse_silu_fp8=fuse_silu_fp8,
        )

    @property
    def triton(self) -> bool:
        """Whether the Triton kernels run the norms and rotary: with a Triton-based attention backend (CUDA,
        or CPU under TRITON_INTERPRET=1; the selector only picks one where Triton runs)."""
        return self.attention_backend is not None and self.attention_backend.name in TRITON_BACKENDS

    def runs_cpu_kernel(self, extension: str) -> bool:
        """Whether the C++ kernel `extension` (`kernels/<extension>.cpp`) runs here."""
        return extension in self.cpu_kernels
