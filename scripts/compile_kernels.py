"""Compile every Triton kernel for an NVIDIA GPU on a machine without one, and report its resources.

    python scripts/compile_kernels.py                 # sm_90 (H100/H200), every model shape and dtype,
    #                                                   KV cache in the model dtype and in FP8
    python scripts/compile_kernels.py --arch 80 --json out.json

Triton's interpreter (how `make test` runs the kernels on CPU) executes kernels with numpy and does not
check what only the GPU compiler checks: `tl.dot` operand types, layouts, shared memory. Here each
public launcher in `kernels/` runs on small CPU tensors shaped like a real model's, with its Triton
kernel swapped for a recorder; the launchers that read or write the paged KV cache run twice, over a
cache in the model dtype and over an FP8 (e4m3) one with its scales (the variants whose constexprs say
FP8_KV=True; the model-dtype ones say FP8_KV=False). Each recorded launch goes through Triton's own
argument binder for the target (so arguments are specialized as the JIT would specialize them:
16-byte-divisible pointers and integers, constexprs) and is compiled ahead of time down to a cubin with
Triton's bundled ptxas (no driver, no GPU). Reported per kernel: registers (cuobjdump), the shared
memory the launch requests, local memory (register spills) and the tensor-core instructions of its PTX
(wgmma, mma.sync); in the JSON also the PTX's kinds of conversion (`ptx_conversions`). Must run without
TRITON_INTERPRET (it makes kernels uncompilable objects). Exit status 1 when a kernel fails to compile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_kernels: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")

import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from sluice.benchmarks.gpu.fp8_linear_bench import LATENCY_SWEEP  # noqa: E402
from sluice.engine.loading.model_arch import ModelArchConfig  # noqa: E402
from sluice.engine.loading.presets import preset_arch  # noqa: E402
from sluice.engine.worker.layers.rotary import build_cos_sin_cache  # noqa: E402
from sluice.kernels import (  # noqa: E402
    fp8_block_gemv,
    fp8_block_mm,
    fp8_gemv,
    fp8_quant,
    fp8_skinny_mm,
    merge_attention_partials,
    paged_decode_attention,
    prefill_attention,
    rms_norm,
    rotary,
    rotary_store_kv,
    silu_and_mul,
    skinny_mm,
    split_k,
    store_kv,
)
from sluice.kernels.paged_attention_tile import E4M3_BITS  # noqa: E402
from sluice.kernels.tensor_checks import FP8_KV_DTYPE, KVScales  # noqa: E402

# Shapes that exercise the kernels' constexpr choices: head_dim 64 and 128, GQA 4 and 7, MHA, a head
# count and hidden size that are not powers of two. The first one is also checked in every dtype.
SHAPES = ("llama-3.2-1b", "llama-3-8b", "llama-2-7b", "qwen2-0.5b")
EXTRA_DTYPES = (torch.float16, torch.float32)
BLOCK_SIZE = 16
# Decode launches (batch, context): the split count comes from batch x KV heads vs the SM count (132 off
# a GPU) and the context, so these give a few slices (graph capture limit), the most slices (one 128k
# sequence) and a single split (a large batch: the split kernel writes the output, no reduce).
DECODE_LAUNCHES = ((3, 8192), (1, 131072), (64, 4096))
# ... and a few slices merged by the split kernel's last one instead of the reduce launch
# (`DecodeConfig.fused_reduce`, off by default: the GPU check's partitions rows time it).
FUSED_REDUCE_DECODE_LAUNCH = (3, 8192)
# Prefill launches (num_seqs, max_query_len, max_seq_len): a batch of short queries shrinks the tile to the
# GQA group; one long prompt takes the full tile; two verify-sized queries after 32k positions and a
# 256-token chunk after 32k (the full tile) split their contexts (split-KV, then the partials' merge).
PREFILL_LAUNCHES = ((3, 1, None), (1, 4096, None), (2, 4, 32768), (1, 256, 32768))
# What a launcher picks on a GPU without e4m3 (compute capability below 8.9), for targets below sm_89,
# and without programmatic dependent launch (below 9.0: `dependent_launch`), for targets below sm_90.
OLDER_GPU_E4M3 = {"E4M3_UPCAST": E4M3_BITS, "HW_E4M3": False}
OLDER_GPU_PDL = {"PDL": False, "launch_pdl": False}
_TYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
}
_KERNELS = (
    (store_kv, "_store_kv_kernel"),
    (paged_decode_attention, "_decode_partition_kernel"),
    (paged_decode_attention, "_decode_reduce_kernel"),
    (prefill_attention, "_prefill_attention_kernel"),
    (merge_attention_partials, "_merge_attention_partials_kernel"),
    (rms_norm, "_rms_norm_kernel"),
    (rotary, "_rotary_kernel"),
    (rotary_store_kv, "_rotary_store_kv_kernel"),
    (silu_and_mul, "_silu_and_mul_kernel"),
    (silu_and_mul, "_silu_and_mul_fp8_kernel"),
    (silu_and_mul, "_silu_and_mul_fp8_groups_kernel"),
    (fp8_quant, "_fp8_quant_kernel"),
    (fp8_gemv, "_fp8_gemv_kernel"),
    (fp8_skinny_mm, "_fp8_skinny_kernel"),
    (split_k, "_fp8_skinny_reduce_kernel"),
    (fp8_block_mm, "_quantize_groups_kernel"),
    (fp8_block_mm, "_fp8_block_mm_kernel"),
    (fp8_block_gemv, "_fp8_block_gemv_kernel"),
    (skinny_mm, "_skinny_kernel"),
)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a launcher issued it (arguments as passed, grid dropped)."""

    kernel: triton.JITFunction
    args: tuple[object, ...]
    kwargs: dict[str, object]


@dataclass(frozen=True)
class Specialized:
    """A launch bound and specialized for a target, exactly as Triton's JIT would compile it."""

    kernel: triton.JITFunction
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], object]
    attrs: dict[tuple[int, ...], list]
    options: dict[str, object]

    @property
    def key(self) -> str:
        parts = [
            self.kernel.__name__,
            self.signature,
            sorted(self.constexprs.items()),
            sorted(self.attrs.items()),
            [self.options.get("num_warps"), self.options.get("num_stages")],  # compiled apart, too
        ]
        return json.dumps(parts, default=str)

    def describe_constexprs(self) -> str:
        names = list(self.signature)
        return ", ".join(f"{names[path[0]]}={value}" for path, value in self.constexprs.items())


def specialize(launch: Launch, backend: BaseBackend) -> Specialized:
    """Triton's runtime path (`JITFunction.run` up to compilation), minus the device queries."""
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.kwargs, bound_args, specialization, options
    )
    return Specialized(kernel, signature, constexprs, attrs, options.__dict__)


@dataclass(frozen=True)
class Compiled:
    kernel: str
    shape: str
    dtype: str
    constexprs: str
    registers: int | None
    shared_bytes: int | None
    local_bytes: int | None
    wgmma: int | None = None  # tensor-core instructions in the PTX: Hopper's warpgroup MMA
    mma_sync: int | None = None  # ... and the warp-level MMA of sm_80+
    conversions: tuple[str, ...] | None = None  # the PTX's kinds of `cvt` (`ptx_conversions`)
    pdl: bool | None = None  # launched with programmatic dependent launch (Triton's `launch_pdl`)
    before_wait: tuple[int, int, int] | None = None  # `memory_before_wait` of its PTX
    error: str | None = None


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records a Launch instead of running."""

    def __init__(self, kernel: triton.JITFunction, sink: list[Launch]) -> None:
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def record(*args: object, **kwargs: object) -> None:
            self.sink.append(Launch(self.kernel, args, kwargs))

        return record


def record_launches(shape: str, dtype: torch.dtype) -> list[Launch]:
    """Every kernel launch the engine issues for a model of `shape` in `dtype` (decode, prefill, store,
    fused rotary + store, each over a model-dtype and an FP8 KV cache, decode and prefill over the FP8
    one in both FOLD_KV_SCALES paths; norm with and without residual, rotary, silu_and_mul; the FP8
    linears' activation quantization), recorded from the real launchers on CPU tensors."""
    with _recording() as sink:
        _run_launchers(shape, dtype)
    return sink


@contextlib.contextmanager
def _recording() -> Iterator[list[Launch]]:
    """Every kernel of `_KERNELS` swapped for a `_Recorder` into the list yielded, put back after."""
    sink: list[Launch] = []
    originals = [(module, name, getattr(module, name)) for module, name in _KERNELS]
    for module, name, kernel in originals:
        setattr(module, name, _Recorder(kernel, sink))
    try:
        yield sink
    finally:
        for module, name, kernel in originals:
            setattr(module, name, kernel)


def _run_launchers(shape: str, dtype: torch.dtype) -> None:
    arch = preset_arch(shape)
    _run_cache_launchers(arch, dtype, kv_scales=None)
    num_tokens = 3
    q = torch.empty(num_tokens, arch.num_attention_heads, arch.head_dim, dtype=dtype)
    k = torch.empty(num_tokens, arch.num_key_value_heads, arch.head_dim, dtype=dtype)
    hidden = torch.empty(num_tokens, arch.hidden_size, dtype=dtype)
    weight = torch.empty(arch.hidden_size, dtype=dtype)
    rms_norm.rms_norm(hidden, weight, 1e-5)
    rms_norm.rms_norm(hidden, weight, 1e-5, residual=hidden)
    cos_sin = build_cos_sin_cache(arch.head_dim, 8, arch.rope_theta, arch.rope_scaling)
    rotary.rotary_embedding(torch.zeros(num_tokens, dtype=torch.int64), q, k, cos_sin)
    silu_and_mul.silu_and_mul(torch.empty(num_tokens, 2 * arch.intermediate_size, dtype=dtype))
    # `--quantization fp8` (and FP8 checkpoints): the linears' inputs, per token and static, one tile
    # (hidden size) and two passes over wider rows (intermediate size: down_proj's input).
    for width in (arch.hidden_size, arch.intermediate_size):
        activations = torch.empty(num_tokens, width, dtype=dtype)
        fp8_quant.quantize_fp8_per_token(activations)
        fp8_quant.quantize_fp8_static(activations, torch.ones(()))
        fp8_quant.quantize_fp8_per_token(activations, scale_ub=1200.0)  # fbgemm_fp8's capped amax
    # ... or the kernels before them write the codes (the norms before qkv / gate_up, SiLU-and-mul before
    # down: `KernelConfig.fuse_fp8_quant_norm` / `_silu`), per token and static, with and without the
    # residual add.
    for input_scale in (None, torch.ones(())):
        rms_norm.rms_norm_fp8_quant(hidden, weight, 1e-5, input_scale=input_scale)
        rms_norm.rms_norm_fp8_quant(hidden, weight, 1e-5, residual=hidden, input_scale=input_scale)
        gate_up = torch.empty(num_tokens, 2 * arch.intermediate_size, dtype=dtype)
        silu_and_mul.silu_and_mul_fp8_quant(gate_up, input_scale)
    # ... and in activation groups of 128 columns, block FP8's (below), and with fbgemm_fp8's cap on the
    # per-token amax: dynamic only.
    rms_norm.rms_norm_fp8_quant(hidden, weight, 1e-5, residual=hidden, group_size=128)
    silu_and_mul.silu_and_mul_fp8_quant(gate_up, group_size=128)
    rms_norm.rms_norm_fp8_quant(hidden, weight, 1e-5, residual=hidden, scale_ub=1200.0)
    silu_and_mul.silu_and_mul_fp8_quant(gate_up, scale_ub=1200.0)
    # Their batch-1 steps (`fp8_gemv`: quantization and product in one launch, one row), o_proj's and
    # down_proj's shapes, per token and static, with the tile an H100 gets (`device_sm_count` off a GPU).
    for width in (arch.hidden_size, arch.intermediate_size):
        codes = torch.empty(arch.hidden_size, width, dtype=torch.float8_e4m3fn)
        scales = torch.ones(arch.hidden_size)
        activations = torch.empty(1, width, dtype=dtype)
        fp8_gemv.fp8_gemv(activations, codes, scales)
        fp8_gemv.fp8_gemv(activations, codes, scales, torch.ones(()))
        fp8_gemv.fp8_gemv(activations, codes, scales, scale_ub=1200.0)  # fbgemm_fp8's cap
        # The kernel_bench sweep's latency candidates (pipelined or prefetched tiles, split K, a wider amax
        # pass) as it launches them (one row, per token), in its shapes and dtype only.
        if shape in ("llama-3-8b", "llama-3.2-1b") and dtype == torch.bfloat16:
            for config in LATENCY_SWEEP:
                fp8_gemv.fp8_gemv(activations, codes, scales, config=config)
        # Steps of 3-64 rows (`fp8_skinny_mm` on fp8_quant's codes): 16 and 64 rows, K split as on an H100;
        # in the kernel_bench's shapes also with the split K added up in the same launch (`fused_reduce`).
        for rows in (16, 64):
            x_q = torch.empty(rows, width, dtype=torch.float8_e4m3fn)
            fp8_skinny_mm.fp8_skinny_mm(x_q, torch.ones(rows, 1), codes, scales, dtype)
            if shape in ("llama-3-8b", "llama-3.2-1b") and dtype == torch.bfloat16:
                sm_count = fp8_skinny_mm.SWEPT_SM_COUNT  # an H100's
                config = fp8_skinny_mm.skinny_config(arch.hidden_size, width, sm_count, rows)
                fused = replace(config, fused_reduce=True)
                fp8_skinny_mm.fp8_skinny_mm(x_q, torch.ones(rows, 1), codes, scales, dtype, fused)
        # The float linears on Sluice's launch (`skinny_linears`): one row and 64, o_proj's and down_proj's
        # shapes, K split as on an H100; down_proj also on the [gate | up] rows (SiLU-and-mul in its loads),
        # a hidden-wide one-row input also with its RMSNorm (and residual add) in its loads, and so the FP8
        # launches (`fuse_norm_fp8`, `fuse_silu_fp8`: the codes made in their loads; per token, static).
        float_weight = torch.empty(arch.hidden_size, width, dtype=dtype)
        for rows in (1, 64):
            skinny_mm.skinny_mm(torch.empty(rows, width, dtype=dtype), float_weight)
            if width == arch.intermediate_size:
                skinny_mm.skinny_mm(torch.empty(rows, 2 * width, dtype=dtype), float_weight, gated=True)
        if width == arch.intermediate_size:
            gate_up = torch.empty(1, 2 * width, dtype=dtype)
            for input_scale in (None, torch.ones(())):
                fp8_skinny_mm.fp8_gated_skinny_mm(gate_up, codes, scales, input_scale)
                fp8_gemv.fp8_gated_gemv(gate_up, codes, scales, input_scale)
        if width == arch.hidden_size:
            row = torch.empty(1, width, dtype=dtype)
            for residual in (None, torch.empty_like(row)):
                residual_out = None if residual is None else torch.empty_like(row)
                norm = rms_norm.RowNorm(torch.empty(width, dtype=dtype), 1e-5, residual, residual_out)
                skinny_mm.skinny_mm(row, float_weight, norm=norm)
                fp8_skinny_mm.fp8_normed_skinny_mm(row, norm, codes, scales)
                fp8_gemv.fp8_normed_gemv(row, norm, codes, scales)
            fp8_skinny_mm.fp8_normed_skinny_mm(row, norm, codes, scales, torch.ones(()))
            fp8_gemv.fp8_normed_gemv(row, norm, codes, scales, torch.ones(()))
        # Block-wise FP8 checkpoints (128 x 128 weight blocks, activation groups of 128 columns): the group
        # quantization and the block-scaled product at one row and at 64 (both of its tiles), and the
        # one-launch gemv of their one-row steps.
        block = (128, 128)
        fp8_block_mm.quantize_fp8_groups(torch.empty(num_tokens, width, dtype=dtype), block[1])
        block_scales = torch.ones(-(-arch.hidden_size // 128), -(-width // 128))
        for rows in (1, 64):
            x_q = torch.empty(rows, width, dtype=torch.float8_e4m3fn)
            fp8_block_mm.fp8_block_mm(
                x_q, torch.ones(rows, block_scales.shape[1]), codes, block_scales, block, dtype
            )
        fp8_block_gemv.fp8_block_gemv(activations, codes, block_scales, block)
        # Their steps of 2-64 rows (`fp8_block_skinny_mm`): 16 and 64 rows, K split as on an H100 (the
        # reduce then adds partial sums scaled already).
        for rows in (16, 64):
            x_q = torch.empty(rows, width, dtype=torch.float8_e4m3fn)
            x_scale = torch.ones(rows, block_scales.shape[1])
            fp8_skinny_mm.fp8_block_skinny_mm(x_q, x_scale, codes, block_scales, block, dtype)
    # The same cache launches over an FP8 cache (`--kv-cache-dtype fp8`): e4m3 codes with their scales,
    # float32 scalars as the attention layers hold them; the variants are the ones with FP8_KV=True. The
    # attention kernels read it in both ways of applying the scales (FOLD_KV_SCALES=True / False).
    for fold_kv_scales in (True, False):
        _run_cache_launchers(arch, dtype, (torch.ones(()), torch.ones(())), fold_kv_scales)


def _run_cache_launchers(
    arch: ModelArchConfig, dtype: torch.dtype, kv_scales: KVScales | None, fold_kv_scales: bool | None = None
) -> None:
    """The launches that read or write the paged KV cache (store, fused rotary + store, decode, prefill),
    over a cache in the model dtype (kv_scales None) or in FP8 (e4m3 codes read with kv_scales, the
    attention kernels applying them as `fold_kv_scales` says)."""
    heads, kv_heads, dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    num_tokens, num_blocks = 3, 4
    q = torch.empty(num_tokens, heads, dim, dtype=dtype)
    k = torch.empty(num_tokens, kv_heads, dim, dtype=dtype)
    cache_dtype = dtype if kv_scales is None else FP8_KV_DTYPE
    cache = torch.empty(num_blocks, BLOCK_SIZE, kv_heads, dim, dtype=cache_dtype)
    slots = torch.zeros(num_tokens, dtype=torch.int64)
    store_kv.store_kv(k, k, cache, cache, slots, kv_scales)
    default = paged_decode_attention.decode_config(dim, dtype, fp8_kv=kv_scales is not None)
    fused = replace(default, fused_reduce=True)
    for (batch, context), config in [(launch, default) for launch in DECODE_LAUNCHES] + [
        (FUSED_REDUCE_DECODE_LAUNCH, fused)
    ]:
        paged_decode_attention.paged_decode_attention(
            torch.empty(batch, heads, dim, dtype=dtype), cache, cache,
            torch.zeros(batch, 1, dtype=torch.int32), torch.ones(batch, dtype=torch.int32), 1.0, context,
            kv_scales=kv_scales, fold_kv_scales=fold_kv_scales, config=config,
        )  # fmt: skip
    for num_seqs, max_query_len, max_seq_len in PREFILL_LAUNCHES:
        tokens = num_seqs * max_query_len  # a real token count, so the tile count is not a constant 1
        query_start_loc = torch.arange(0, tokens + 1, max_query_len, dtype=torch.int32)
        prefill_attention.prefill_attention(
            torch.empty(tokens, heads, dim, dtype=dtype), cache, cache, query_start_loc,
            query_start_loc.diff(), torch.zeros(num_seqs, 1, dtype=torch.int32), max_query_len, 1.0,
            kv_scales=kv_scales, fold_kv_scales=fold_kv_scales, max_seq_len=max_seq_len,
        )  # fmt: skip
    cos_sin = build_cos_sin_cache(dim, 8, arch.rope_theta, arch.rope_scaling)
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    rotary_store_kv.rotary_store_kv(positions, q, k, k, cos_sin, cache, cache, slots, kv_scales)


def compile_launch(launch: Specialized, target: GPUTarget, cuobjdump: Path) -> tuple[object, ...]:
    """Compiles to a cubin; returns (registers per thread, shared bytes per program, local bytes: spills,
    then `tensor_core_instructions`, `ptx_conversions`, whether it launches with PDL and
    `memory_before_wait` of its PTX)."""
    source = ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs)
    compiled = triton.compile(source, target=target, options=launch.options)
    with tempfile.TemporaryDirectory() as directory:
        cubin = Path(directory) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    registers, _, local = parse_resource_usage(usage)
    # Triton's shared memory is dynamic: the launch requests metadata.shared bytes, which cuobjdump's
    # static SHARED figure does not include.
    ptx = compiled.asm["ptx"]
    return (
        registers, compiled.metadata.shared, local, *tensor_core_instructions(ptx), ptx_conversions(ptx),
        bool(launch.options.get("launch_pdl")), memory_before_wait(ptx),
    )  # fmt: skip


def memory_before_wait(ptx: str) -> tuple[int, int, int] | None:
    """(global loads, global stores and atomics, L2 prefetches) of a PTX before its first
    `griddepcontrol.wait`, in program text (the kernels wait in their first block); None without one. A
    kernel launched with PDL may run while the kernel before it still writes: before the wait it may load
    only what never changes in a step (weights) and store nothing (`sluice.kernels.dependent_launch`)."""
    head, wait, _ = ptx.partition("griddepcontrol.wait")
    if not wait:
        return None

    def count(pattern: str) -> int:
        return len(re.findall(rf"^\s*(?:@!?%p\d+\s+)?(?:{pattern})", head, re.MULTILINE))

    return count(r"ld\.global|cp\.async"), count(r"st\.global|atom\.|red\."), count(r"prefetch\.global\.L2")


def ptx_conversions(ptx: str) -> tuple[str, ...]:
    """The distinct conversion instructions of a PTX, sorted (`cvt.rn.satfinite.e4m3x2.f32`: the GPU's
    e4m3 quantization; `cvt.bf16.f16`: fp16 to bf16, one value an instruction): what the interpreter's
    runs cannot show of how a kernel converts."""
    return tuple(sorted(set(re.findall(r"\bcvt(?:\.[a-z0-9]+)+", ptx))))


def tensor_core_instructions(ptx: str) -> tuple[int, int]:
    """(wgmma, mma.sync): how many of each tensor-core instruction the PTX holds (in its code, not how
    often they run). A `tl.dot` Triton lowers to wgmma on sm_90 when the tile allows (64-row warpgroups),
    to mma.sync otherwise; an fp32 "ieee" dot to neither (FMAs)."""
    wgmma = len(re.findall(r"^\s*(?:@%p\d+\s+)?wgmma\.mma_async", ptx, re.MULTILINE))
    mma_sync = len(re.findall(r"^\s*(?:@%p\d+\s+)?mma\.sync", ptx, re.MULTILINE))
    return wgmma, mma_sync


def parse_resource_usage(text: str) -> tuple[int, int, int]:
    """REG, SHARED and LOCAL + STACK (local memory: spills) of the one function in `cuobjdump
    --dump-resource-usage` output. ptxas may spill into the stack frame with LOCAL:0: a one-row fp8_gemv
    tile of 128 weight bytes a thread, prefetched, gave "REG:32 STACK:2448 LOCAL:0"."""
    fields = dict(re.findall(r"\b(REG|SHARED|LOCAL|STACK):(\d+)", text))
    if set(fields) != {"REG", "SHARED", "LOCAL", "STACK"}:
        raise ValueError(f"cuobjdump output without REG/SHARED/LOCAL/STACK: {text!r}")
    return int(fields["REG"]), int(fields["SHARED"]), int(fields["LOCAL"]) + int(fields["STACK"])


def compile_all(arch: int, jobs: int = os.cpu_count() or 1) -> Iterator[Compiled]:
    """Every distinct launch of every shape and dtype, compiled for sm_`arch`, `jobs` at a time, in order.
    Threads are enough: Triton's compiler and ptxas run without the GIL (24 of the 8b launches: 8.0 s one
    at a time, 4.2 s two at a time on 2 cores)."""
    target = GPUTarget("cuda", arch, 32)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with ThreadPoolExecutor(jobs) as pool:
        yield from pool.map(lambda item: _compile(*item, target, cuobjdump), _distinct_launches(target))


def _distinct_launches(target: GPUTarget) -> Iterator[tuple[tuple[str, str, str, str], Specialized]]:
    """(kernel, shape, dtype, constexprs) and the launch, once per distinct specialization."""
    backend = make_backend(target)
    configs = [(shape, torch.bfloat16) for shape in SHAPES] + [(SHAPES[0], d) for d in EXTRA_DTYPES]
    seen: set[str] = set()
    for shape, dtype in configs:
        for launch in record_launches(shape, dtype):
            launch = _as_older_gpu(launch, target.arch)
            specialized = specialize(launch, backend)
            if specialized.key in seen:
                continue
            seen.add(specialized.key)
            names = (launch.kernel.__name__, shape, _TYPE_NAMES[dtype], specialized.describe_constexprs())
            yield names, specialized


def _as_older_gpu(launch: Launch, arch: int) -> Launch:
    """`launch` as a launcher picks it on a GPU of compute capability arch / 10: without e4m3 conversions
    below sm_89 (`store_kv.gpu_e4m3`), without PDL below sm_90 (`dependent_launch`)."""
    older = {**(OLDER_GPU_E4M3 if arch < 89 else {}), **(OLDER_GPU_PDL if arch < 90 else {})}
    picked = {key: value for key, value in older.items() if key in launch.kwargs}
    return Launch(launch.kernel, launch.args, {**launch.kwargs, **picked}) if picked else launch


def _compile(
    names: tuple[str, str, str, str], launch: Specialized, target: GPUTarget, cuobjdump: Path
) -> Compiled:
    try:
        return Compiled(*names, *compile_launch(launch, target, cuobjdump))
    except Exception as error:  # noqa: BLE001 (report every failing kernel, not just the first)
        return Compiled(*names, None, None, None, error=f"{type(error).__name__}: {error}"[:2000])


# A server's steps, as the attention kernels see them (bf16, SERVING_SHAPE, a model-dtype cache): prefill
# batches of one to 64 prompts whose longest query fills the full tile, over block tables 1 to 256 blocks
# wide (max_seq_len as wide: the few-sequence ones over more than a partition split their contexts);
# decode batches of 1 to 64 over contexts short and long.
SERVING_SHAPE = "llama-3.2-1b"
SERVING_PREFILL = ((1, 1), (1, 256), (2, 3), (3, 40), (15, 8), (16, 16), (17, 9), (32, 33), (64, 16))
SERVING_PREFILL_QUERY_LEN = 64
SERVING_DECODE = tuple((batch, context) for batch in (1, 2, 3, 16, 17, 64) for context in (200, 4096, 32768))


def record_serving_launches() -> list[Launch]:
    """The attention launches of SERVING_PREFILL and SERVING_DECODE, recorded from the real launchers."""
    arch = preset_arch(SERVING_SHAPE)
    heads, kv_heads, dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    cache = torch.empty(4, BLOCK_SIZE, kv_heads, dim, dtype=torch.bfloat16)
    with _recording() as sink:
        query_len = SERVING_PREFILL_QUERY_LEN
        for num_seqs, width in SERVING_PREFILL:
            starts = torch.arange(0, num_seqs * query_len + 1, query_len, dtype=torch.int32)
            prefill_attention.prefill_attention(
                torch.empty(num_seqs * query_len, heads, dim, dtype=torch.bfloat16), cache, cache, starts,
                starts.diff(), torch.zeros(num_seqs, width, dtype=torch.int32), query_len, 1.0,
                max_seq_len=width * BLOCK_SIZE,
            )  # fmt: skip
        for batch, context in SERVING_DECODE:
            width = -(-context // BLOCK_SIZE)
            paged_decode_attention.paged_decode_attention(
                torch.empty(batch, heads, dim, dtype=torch.bfloat16), cache, cache,
                torch.zeros(batch, width, dtype=torch.int32), torch.ones(batch, dtype=torch.int32), 1.0,
                context,
            )  # fmt: skip
    return sink


def serving_variants(arch: int) -> dict[str, dict[str, int]]:
    """Per attention kernel: the launches a serving workload issues and the distinct variants Triton's JIT
    compiles for them on sm_`arch` (each a compile, ~1-3 s, the first time a step needs it)."""
    backend = make_backend(GPUTarget("cuda", arch, 32))
    keys: dict[str, set[str]] = {}
    launches: dict[str, int] = {}
    for launch in record_serving_launches():
        name = launch.kernel.__name__
        keys.setdefault(name, set()).add(specialize(launch, backend).key)
        launches[name] = launches.get(name, 0) + 1
    return {name: {"launches": launches[name], "variants": len(keys[name])} for name in keys}


def markdown_report(results: list[Compiled], arch: int) -> str:
    lines = [
        f"| kernel | shape | dtype | registers / thread | shared bytes | local (spill) bytes "
        f"| wgmma / mma.sync | sm_{arch} | constexprs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        status = "ok" if r.error is None else "FAILED"
        lines.append(
            f"| `{r.kernel}` | {r.shape} | {r.dtype} | {r.registers} | {r.shared_bytes} | {r.local_bytes} "
            f"| {r.wgmma} / {r.mma_sync} | {status} | {r.constexprs} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100), 80 (A100)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="compiles at a time (default: the cores)"
    )
    parser.add_argument("--markdown", help="write a markdown table of the results to this file")
    parser.add_argument(
        "--serving-variants",
        action="store_true",
        help="print, as JSON, how many variants the attention kernels compile for a serving workload",
    )
    args = parser.parse_args(argv)
    if args.serving_variants:
        print(json.dumps(serving_variants(args.arch), indent=2))
        return 0
    results = []
    print(f"{'kernel':<28}{'shape':<14}{'dtype':<6}{'regs':>6}{'shared':>8}{'local':>7}  status")
    for r in compile_all(args.arch, args.jobs):
        results.append(r)
        status = "ok" if r.error is None else f"FAILED {r.error.splitlines()[0]}"
        usage = (r.registers, r.shared_bytes, r.local_bytes) if r.error is None else ("-", "-", "-")
        print(f"{r.kernel:<28}{r.shape:<14}{r.dtype:<6}{usage[0]:>6}{usage[1]:>8}{usage[2]:>7}  {status}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown_report(results, args.arch))
    failed = [r for r in results if r.error is not None]
    print(f"{len(results) - len(failed)} of {len(results)} kernel variants compiled for sm_{args.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
