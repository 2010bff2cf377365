"""GPU benchmarks for `scripts/gpu_check.py`: decode steps eager vs CUDA graphs, attention kernels, and
Sluice vs transformers.generate end to end. Timed with CUDA events; the pure helpers are unit-tested on CPU.

Two clocks: `time_cuda_s` times one call on an idle GPU, so the host's launch time counts wherever it is
longer than the GPU's work (right for whole steps, eager against graph replay); `time_kernel_s` times a
kernel alone, many calls captured in one CUDA graph (how decode runs when served, and how a kernel runs
between other launches), so that a Python wrapper's microseconds do not count as the kernel's.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from sluice.engine.loading.fp8_config import Fp8Config
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.presets import preset_arch
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.attention.metadata import AttentionMetadata
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.engine.worker.cuda_graph_runner import CudaGraphRunner
from sluice.engine.worker.input_batch import ModelInputs, build_model_inputs
from sluice.engine.worker.layers.activation import GatedActivation
from sluice.engine.worker.layers.attention import Attention
from sluice.engine.worker.layers.fp8_linear import Fp8LinearMethod
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear import LinearBase
from sluice.engine.worker.layers.linear_method import UnquantizedLinearMethod
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.engine.worker.layers.quantization import float_linear_method
from sluice.engine.worker.models.llama import LlamaForCausalLM
from sluice.kernels.compile_target import device_sm_count
from sluice.kernels.paged_decode_attention import (
    DEFAULT_PARTITION_SIZE,
    DecodeConfig,
    decode_config,
    paged_decode_attention,
    pick_num_splits,
)
from sluice.kernels.prefill_attention import prefill_attention

BLOCK_SIZE = 16
BENCH_BATCHES = (1, 8, 32, 64, 128)  # 64: the serving check's top concurrency
BENCH_CONTEXT = 512
GRAPH_MAX_REL_DIFF = 1e-2  # graph replay vs eager on the same inputs: the same kernels, bf16
CALLS_PER_GRAPH = 20  # the calls `time_kernel_s` captures in one graph


def floor_step_time_s(weight_bytes: int, bandwidth_bytes_per_s: float) -> float:
    """Lower bound of a batch-1 decode step: every weight byte is read once from device memory."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth_bytes_per_s: must be > 0, got {bandwidth_bytes_per_s}")
    return weight_bytes / bandwidth_bytes_per_s


def kv_read_bytes(num_seqs: int, context_len: int, num_kv_heads: int, head_dim: int, item_size: int) -> int:
    """Bytes a decode attention step must read: K and V of every context position of every sequence."""
    return 2 * num_seqs * context_len * num_kv_heads * head_dim * item_size


def decode_requests(
    batch: int, context_len: int, block_size: int, first_block: int = 0
) -> tuple[ScheduledRequest, ...]:
    """`batch` decode rows of `context_len` tokens on disjoint block tables, from `first_block` on."""
    blocks_per_seq = -(-context_len // block_size)
    return tuple(
        ScheduledRequest(
            request_id=f"b{i}",
            token_ids=(1 + i,),
            start_position=context_len - 1,
            block_ids=tuple(range(first_block + i * blocks_per_seq, first_block + (i + 1) * blocks_per_seq)),
            sample=True,
        )
        for i in range(batch)
    )


def decode_step_inputs(
    batch: int, context_len: int, block_size: int, device: torch.device, first_block: int = 0
) -> ModelInputs:
    """A pure-decode step for `batch` sequences of `context_len` tokens with disjoint block tables."""
    scheduled = decode_requests(batch, context_len, block_size, first_block)
    return build_model_inputs(SchedulerOutput(scheduled, batch), block_size, device)


def time_cuda_s(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events around each call on an otherwise idle GPU: the host's
    time to launch it counts where it is longer than the GPU's (a step's, eager or replayed)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def time_graph_s(sequence: Sequence[Callable[[], object]], repeats: int = 7) -> float:
    """Seconds per call of `sequence` on the GPU alone: every call run once on a side stream (compiles,
    warm-up), then all of them captured in one CUDA graph, and the median over `repeats` replays divided
    by their number. No host time counts: what the calls cost inside a served graph, or queued behind
    other work. The calls must be capturable (no host sync); their outputs come from the graph's pool."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in sequence[:3]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in sequence:
            call()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(sequence))
    del graph
    return sorted(times)[len(times) // 2]


def time_kernel_s(fn: Callable[[], object], calls: int = CALLS_PER_GRAPH, repeats: int = 7) -> float:
    """Seconds per call of `fn` with no host time: `calls` calls of it in one CUDA graph (`time_graph_s`)."""
    return time_graph_s([fn] * calls, repeats)


def copy_bandwidth_bytes_per_s(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting the read and the write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / time_cuda_s(lambda: dst.copy_(src), iters=10)


def matmul_flops_per_s(device: torch.device, size: int = 8192) -> float:
    """bf16 matrix product rate on random data (size x size x size), the FLOP ceiling of prefill."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    return 2 * size**3 / time_cuda_s(lambda: a @ b, iters=10)


def triton_model(
    arch: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    fp8: Fp8Config | None = None,
) -> LlamaForCausalLM:
    """Our model as ModelRunner builds it on CUDA: Triton attention, fused RMSNorm and rotary; with `fp8`,
    FP8 linears (`--quantization fp8`: QUANTIZE_AT_LOAD)."""
    kernels = _kernels(device, dtype, fp8)
    return LlamaForCausalLM(arch, kernels, max_positions)


def _kernels(device: torch.device, dtype: torch.dtype, fp8: Fp8Config | None) -> KernelConfig:
    quantization = "fp8" if fp8 is not None else None
    return KernelConfig.for_model(device, dtype, TritonAttentionBackend(), quantization, fp8=fp8)


def _random_model(
    arch: ModelArchConfig, dtype: torch.dtype, device: torch.device, fp8: Fp8Config | None = None
) -> LlamaForCausalLM:
    model = triton_model(arch, dtype, device, max_positions=4 * BENCH_CONTEXT, fp8=fp8)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
        if fp8 is not None:  # the random float weights quantized, as the loader's last pass does
            for module in model.modules():
                if hasattr(module, "process_weights_after_loading"):
                    module.process_weights_after_loading()
    return model.eval()


def random_kv_caches(
    arch: ModelArchConfig, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
    return [
        (torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device))
        for _ in range(arch.num_hidden_layers)
    ]


def bench_decode(device: torch.device) -> tuple[list[list[object]], float, float]:
    """Rows (batch, eager ms, graph ms, speedup, graph vs eager max relative difference) and the graph
    pool size; batch-1 graph step seconds; weight bytes. A step is the forward plus the logits of the
    sampled rows."""
    arch = preset_arch("llama-3.2-1b")
    model = _random_model(arch, torch.bfloat16, device)
    blocks_per_seq = -(-BENCH_CONTEXT // BLOCK_SIZE)
    kv_caches = random_kv_caches(arch, max(BENCH_BATCHES) * blocks_per_seq + 1, torch.bfloat16, device)
    runner = CudaGraphRunner(model, kv_caches, max(BENCH_BATCHES), blocks_per_seq, BLOCK_SIZE, device)

    def eager(inputs: ModelInputs) -> torch.Tensor:
        return model(inputs.input_ids, inputs.positions, kv_caches, inputs.metadata)

    rows, batch1_graph_s = [], 0.0
    with torch.inference_mode():
        runner.capture()
        for batch in BENCH_BATCHES:
            inputs = decode_step_inputs(batch, BENCH_CONTEXT, BLOCK_SIZE, device)
            difference = relative_difference(runner.run(inputs).clone(), eager(inputs))
            eager_s = time_cuda_s(lambda i=inputs: _logits(model, eager(i), i))
            graph_s = time_cuda_s(lambda i=inputs: _logits(model, runner.run(i), i))
            batch1_graph_s = graph_s if batch == 1 else batch1_graph_s
            rows.append([batch, eager_s * 1e3, graph_s * 1e3, eager_s / graph_s, difference])
    rows.append(["graph pool MiB", runner.memory_bytes / 2**20, "", "", ""])
    return rows, batch1_graph_s, _weight_bytes(model)


def select_attention(model: torch.nn.Module, kernels: KernelConfig) -> int:
    """Re-select every attention layer of `model` with `kernels` (its backend, the fusion); returns the
    layers."""
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    for layer in layers:
        layer.select(kernels)
    return len(layers)


def select_float_linears(model: torch.nn.Module, kernels: KernelConfig) -> int:
    """Give every linear of `model` in the model dtype the method `kernels` picks (cuBLAS's or Sluice's
    skinny launch: `skinny_linears`; the same weight layout on a GPU), every FP8 one its method again with
    `fuse_norm_fp8` and `fuse_silu_fp8` (the same weights), and re-select the MLPs' activations and the
    RMSNorms (whether SiLU-and-mul runs in down_proj's launch, a norm in its linear's: `fuse_silu_skinny`,
    `fuse_norm_skinny`, `fuse_norm_fp8`, `fuse_silu_fp8`); returns the float linears."""
    layers = [
        module
        for module in model.modules()
        if isinstance(module, LinearBase) and isinstance(module.method, UnquantizedLinearMethod)
    ]
    for layer in layers:
        layer.method = float_linear_method(kernels)
    for module in model.modules():
        if isinstance(module, LinearBase) and isinstance(module.method, Fp8LinearMethod):
            method = module.method
            module.method = Fp8LinearMethod(
                method.scheme, method.matmul, kernels.fuse_norm_fp8, kernels.fuse_silu_fp8
            )
    for module in model.modules():
        if isinstance(module, (GatedActivation, RMSNorm)):
            module.select(kernels)
    return len(layers)


# A graph step variant: (its kernels from the default KernelConfig, the longest context its graph is captured
# for[, environment variables set while it is captured and timed, e.g. `dependent_launch.PDL_ENV`]).
GraphVariant = (
    tuple[Callable[[KernelConfig], KernelConfig], int]
    | tuple[Callable[[KernelConfig], KernelConfig], int, dict[str, str]]
)


def time_batch1_graph_steps(
    device: torch.device,
    preset: str,
    context: int,
    variants: Sequence[GraphVariant],
    time_s: Callable[[Callable[[], object]], float] = time_cuda_s,
    fp8: Fp8Config | None = None,
) -> tuple[ModelArchConfig, list[tuple[float, float]]]:
    """The batch-1 CUDA-graph decode step of `preset` (random bf16 weights; with `fp8`, its linears
    quantized to FP8 at load) at a `context`-token context, once per variant (`GraphVariant`). Returns the
    preset's shape and, per variant, (seconds a step, the logits' max relative difference from the first
    variant's); the layers get the default kernels back."""
    arch = preset_arch(preset)
    model = _random_model(arch, torch.bfloat16, device, fp8)
    kernels = _kernels(device, torch.bfloat16, fp8)
    kv_caches = random_kv_caches(arch, -(-context // BLOCK_SIZE) + 1, torch.bfloat16, device)
    inputs = decode_step_inputs(1, context, BLOCK_SIZE, device)
    timings, first = [], None
    with torch.inference_mode():
        for variant, graph_context, *environ in variants:
            select_attention(model, variant(kernels))
            select_float_linears(model, variant(kernels))
            with mock.patch.dict(os.environ, environ[0] if environ else {}):
                runner = CudaGraphRunner(
                    model, kv_caches, 1, -(-graph_context // BLOCK_SIZE), BLOCK_SIZE, device
                )
                runner.capture()
                logits = _logits(model, runner.run(inputs), inputs).clone()
                first = logits if first is None else first
                seconds = time_s(lambda r=runner: _logits(model, r.run(inputs), inputs))
            timings.append((seconds, relative_difference(logits, first)))
            del runner
        select_attention(model, kernels)
        select_float_linears(model, kernels)
    return arch, timings


def bench_rotary_store_fusion(device: torch.device) -> list[list[object]]:
    """The batch-1 CUDA-graph decode step of the llama-3.2-1b shape with rotary + K/V store as one kernel (the
    default) and as two: rows (kernels, graph ms, vs fused, max rel diff of the logits vs fused)."""
    variants = [
        (lambda kernels, fused=fused: dataclasses.replace(kernels, fuse_rotary_store=fused), BENCH_CONTEXT)
        for fused in (True, False)
    ]
    _, ((fused_s, _), (separate_s, difference)) = time_batch1_graph_steps(
        device, "llama-3.2-1b", BENCH_CONTEXT, variants
    )
    return [
        ["rotary + K/V store in one kernel", fused_s * 1e3, 1.0, 0.0],
        ["rotary, then K/V store", separate_s * 1e3, separate_s / fused_s, difference],
    ]


# The batch-1 graph step's decode attention, end to end: (the graph's longest context, the split kernel's
# tile (None: `decode_config`'s), partition size). A graph's split count is sized for its longest context;
# the partition size sets how many of those splits a shorter one uses (at 512 and 128-position tiles, a
# 512-token context is one program per KV head walking 4 tiles; at 128, four). The first row is
# `bench_decode`'s graph, sized for BENCH_CONTEXT; the 8192 rows are a served graph's
# (`max_seq_len_to_capture`), where run 12's kernel sweep timed 32-position partitions 1.69x faster at a
# 256-token context. The 512 rows are the partition before run 15, which timed 128 1.07x faster for 8192
# and the same for 512 (four slices, and the reduce launch they need, against one). The "fused reduce"
# rows are the default tile and partition with the split kernel's last slice merging the slices
# (`DecodeConfig.fused_reduce`): 16 launches a step fewer. The 512 rows with 64- and 32-position tiles and
# partitions (2026-12-06) ask whether what won in the 8192 graph in run 16 (1.05x, 1.08x: a short context's
# slices spread over more programs) wins in the goal's graph too: there the default's four slices give 32
# programs on 132 SMs, 32-position ones 16 slices and 128 programs.
SERVED_GRAPH_CONTEXT = 8192
FUSED_REDUCE_DECODE = DecodeConfig(128, 4, 3, fused_reduce=True)  # bf16's default tile, head_dim <= 128
GRAPH_STEP_PARTITIONS: tuple[tuple[int, DecodeConfig | None, int], ...] = (
    (BENCH_CONTEXT, None, DEFAULT_PARTITION_SIZE),
    (BENCH_CONTEXT, FUSED_REDUCE_DECODE, DEFAULT_PARTITION_SIZE),
    (BENCH_CONTEXT, None, 512),
    (BENCH_CONTEXT, DecodeConfig(64, 4, 3), 64),
    (BENCH_CONTEXT, DecodeConfig(32, 4, 2), 32),
    (SERVED_GRAPH_CONTEXT, None, DEFAULT_PARTITION_SIZE),
    (SERVED_GRAPH_CONTEXT, FUSED_REDUCE_DECODE, DEFAULT_PARTITION_SIZE),
    (SERVED_GRAPH_CONTEXT, None, 512),
    (SERVED_GRAPH_CONTEXT, DecodeConfig(64, 4, 3), 64),
    (SERVED_GRAPH_CONTEXT, DecodeConfig(32, 4, 2), 32),
)


def graph_step_partition_rows(
    partitions: Sequence[tuple[int, DecodeConfig | None, int]],
    timings: Sequence[tuple[float, float]],
    num_kv_heads: int,
    head_dim: int,
    num_sms: int,
) -> list[list[object]]:
    """Rows (graph for, tile, partition, splits, graph step ms, speed vs the first row of the same graph
    size, logits' max rel diff vs the first row) from (seconds, difference) per `partitions` row."""
    rows, baseline = [], {}
    for (graph_context, config, partition), (seconds, difference) in zip(partitions, timings, strict=True):
        baseline.setdefault(graph_context, seconds)
        tile = (config or decode_config(head_dim, torch.bfloat16)).tile_n
        splits = pick_num_splits(1, num_kv_heads, graph_context, num_sms, partition)
        tile_text = f"{tile}" if config else f"{tile} (default)"
        tile_text += ", fused reduce" if config and config.fused_reduce else ""
        partition_text = f"{partition}" if partition != DEFAULT_PARTITION_SIZE else f"{partition} (default)"
        speed = baseline[graph_context] / seconds
        rows.append([graph_context, tile_text, partition_text, splits, seconds * 1e3, speed, difference])
    return rows


def bench_graph_step_partitions(
    device: torch.device,
    preset: str = "llama-3.2-1b",
    context: int = BENCH_CONTEXT,
    partitions: Sequence[tuple[int, DecodeConfig | None, int]] = GRAPH_STEP_PARTITIONS,
    time_s: Callable[[Callable[[], object]], float] = time_cuda_s,
) -> list[list[object]]:
    """The batch-1 CUDA-graph decode step of `preset` (bf16) at a `context`-token context with each of
    `partitions`' decode attention, one graph each (`graph_step_partition_rows`)."""

    def with_backend(config: DecodeConfig | None, partition: int) -> Callable[[KernelConfig], KernelConfig]:
        backend = TritonAttentionBackend(partition, decode_config=config)
        return lambda kernels: dataclasses.replace(kernels, attention_backend=backend)

    variants = [
        (with_backend(config, partition), graph_context) for graph_context, config, partition in partitions
    ]
    arch, timings = time_batch1_graph_steps(device, preset, context, variants, time_s)
    num_sms = device_sm_count(device)
    return graph_step_partition_rows(partitions, timings, arch.num_key_value_heads, arch.head_dim, num_sms)


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float32."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))


def _logits(model: LlamaForCausalLM, hidden: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    return model.compute_logits(hidden[inputs.logits_indices])


def _weight_bytes(model: torch.nn.Module) -> float:
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return float(sum(unique.values()))


@dataclass(frozen=True)
class DecodeProblem:
    """One paged decode attention launch's inputs: `batch` sequences of `context` tokens on disjoint blocks
    laid out in order (sequence s holds blocks s * blocks_per_seq, ...), llama-3.2-1b's heads."""

    context: int
    batch: int
    q: torch.Tensor  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    metadata: AttentionMetadata

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    def contiguous_kv(self, cache: torch.Tensor) -> torch.Tensor:
        """`cache` as [batch, num_kv_heads, context, head_dim], the layout torch SDPA takes."""
        per_seq = cache.view(self.batch, -1, cache.shape[2], cache.shape[3])[:, : self.context]
        return per_seq.transpose(1, 2).contiguous()


def decode_problem(context: int, batch: int, device: torch.device) -> DecodeProblem:
    """Random bf16 q and K/V caches (unit normal) for `bench_attention`'s shapes."""
    arch = preset_arch("llama-3.2-1b")
    md = decode_step_inputs(batch, context, BLOCK_SIZE, device).metadata
    shape = (batch * -(-context // BLOCK_SIZE), BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, arch.num_attention_heads, arch.head_dim, dtype=torch.bfloat16, device=device)
    return DecodeProblem(context, batch, q, k_cache, v_cache, md)


def run_decode_attention(problem: DecodeProblem, **kwargs: Any) -> torch.Tensor:
    """paged_decode_attention on `problem` (kwargs: config, num_splits, partition_size, kv_scales, out, and
    k_cache / v_cache in place of the problem's)."""
    md = problem.metadata
    k_cache, v_cache = kwargs.pop("k_cache", problem.k_cache), kwargs.pop("v_cache", problem.v_cache)
    return paged_decode_attention(
        problem.q, k_cache, v_cache, md.block_tables, md.seq_lens, problem.scale, md.max_seq_len, **kwargs
    )


DECODE_ATTENTION_SHAPES = ((4096, 32), (32768, 8))  # (context, batch)


def bench_attention(device: torch.device, bandwidth: float) -> list[list[object]]:
    """Paged decode attention alone at 4k and 32k context with llama-3.2-1b's heads, in bf16."""
    rows = []
    for context, batch in DECODE_ATTENTION_SHAPES:
        problem = decode_problem(context, batch, device)
        seconds = time_kernel_s(lambda p=problem: run_decode_attention(p))
        kv_heads, head_dim = problem.k_cache.shape[2:]
        moved = kv_read_bytes(batch, context, kv_heads, head_dim, 2)
        rows.append([context, batch, seconds * 1e6, moved / seconds / 1e9, moved / seconds / bandwidth])
        del problem
    return rows


def prefill_step_inputs(prompt_len: int, block_size: int, device: torch.device) -> ModelInputs:
    """One fresh prompt of `prompt_len` tokens prefilled in one step, on blocks 0, 1, 2, ..."""
    blocks = tuple(range(-(-prompt_len // block_size)))
    request = ScheduledRequest("prefill", (1,) * prompt_len, 0, blocks, sample=True)
    return build_model_inputs(SchedulerOutput((request,), prompt_len), block_size, device)


def causal_attention_flops(prompt_len: int, num_heads: int, head_dim: int) -> float:
    """Multiply-adds of QK^T and PV under a causal mask (half the square), 2 flops each."""
    return 2 * 2 * num_heads * head_dim * prompt_len * (prompt_len + 1) / 2


@dataclass(frozen=True)
class PrefillProblem:
    """One fresh causal prompt of `prompt_len` tokens in one step: q, k, v (llama-3.2-1b heads, bf16, unit
    normal) and the paged cache holding k, v in order (blocks 0, 1, ... are views of k and v)."""

    prompt_len: int
    q: torch.Tensor  # [prompt_len, num_heads, head_dim]
    k: torch.Tensor  # [prompt_len, num_kv_heads, head_dim]
    v: torch.Tensor
    metadata: AttentionMetadata

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    def cache(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, BLOCK_SIZE, t.shape[1], t.shape[2])

    def flops(self) -> float:
        return causal_attention_flops(self.prompt_len, self.q.shape[1], self.q.shape[2])


def prefill_problem(prompt_len: int, device: torch.device) -> PrefillProblem:
    arch = preset_arch("llama-3.2-1b")
    md = prefill_step_inputs(prompt_len, BLOCK_SIZE, device).metadata
    q = torch.randn(prompt_len, arch.num_attention_heads, arch.head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(prompt_len, arch.num_key_value_heads, arch.head_dim, dtype=torch.bfloat16, device=device)
    return PrefillProblem(prompt_len, q, k, torch.randn_like(k), md)


def run_prefill_attention(problem: PrefillProblem, **kwargs: Any) -> torch.Tensor:
    """prefill_attention on `problem` (kwargs: config, kv_scales, out, and k_cache / v_cache in place of
    the problem's)."""
    md = problem.metadata
    k_cache = kwargs.pop("k_cache", problem.cache(problem.k))
    v_cache = kwargs.pop("v_cache", problem.cache(problem.v))
    return prefill_attention(
        problem.q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len,
        problem.scale, **kwargs,
    )  # fmt: skip


def sdpa_prefill(problem: PrefillProblem) -> Callable[[], torch.Tensor]:
    """torch's scaled_dot_product_attention on the problem's q/k/v (made contiguous once), causal, GQA;
    the call returns [1, num_heads, prompt_len, head_dim]."""
    import torch.nn.functional as F

    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (problem.q, problem.k, problem.v))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)


PREFILL_PROMPT_LENS = (2048, 8192)


def bench_prefill_attention(device: torch.device) -> list[list[object]]:
    """Our paged varlen prefill kernel against torch's scaled_dot_product_attention (flash) on the same
    q/k/v, contiguous, causal, GQA: one prompt of 2k and of 8k tokens, llama-3.2-1b heads, bf16."""
    rows = []
    for prompt_len in PREFILL_PROMPT_LENS:
        problem = prefill_problem(prompt_len, device)
        ours = time_kernel_s(lambda p=problem: run_prefill_attention(p))
        sdpa = time_kernel_s(sdpa_prefill(problem))
        tflop = problem.flops() / 1e12
        rows.append([prompt_len, ours * 1e3, tflop / ours, sdpa * 1e3, tflop / sdpa, sdpa / ours])
    return rows


def bench_end_to_end(
    device: torch.device, num_requests: int = 16, output_len: int = 64
) -> list[list[object]]:
    """`sluice.benchmarks.engine.offline`'s mixed workload (prompts of 32-512 tokens) on a llama-3.2-1b-shaped
    random bf16 checkpoint: transformers first (its model stays loaded), then the engine with CUDA graphs."""
    from sluice.benchmarks.engine import offline as bench

    with tempfile.TemporaryDirectory() as directory:
        hf = bench.build_checkpoint("llama-3.2-1b", directory, 0, "bfloat16", device.type)
        prompts = bench.mixed_workload(num_requests, hf.config.vocab_size, seed=0)
        results = [
            bench.run_hf_sequential(hf, prompts, output_len),
            bench.run_hf_static_batches(hf, prompts, output_len, 8),
            bench.run_sluice(
                "sluice (LLM, CUDA graphs)", directory, prompts, output_len, device=device.type,
                dtype="bfloat16", gpu_memory_utilization=0.6, max_num_batched_tokens=2048,
            ),
        ]  # fmt: skip
    base = results[0].tokens_per_second
    return [
        [r.name, r.output_tokens, r.seconds, r.tokens_per_second, r.tokens_per_second / base] for r in results
    ]


# Issue 33's kernel-level goals: decode attention's share of the copy bandwidth at (context, batch), and
# prefill attention's speed as a share of torch SDPA's at each prompt length.
DECODE_ATTENTION_GOALS = {(32768, 8): 0.70, (4096, 32): 0.60}
PREFILL_VS_SDPA_GOAL = 0.8
BATCH1_STEP_OVER_FLOOR_GOAL = 1.5


def goal_rows(
    batch1_step_s: float,
    floor_s: float,
    batch1_speedup: float,
    attention_rows: list[list[object]],
    prefill_rows: list[list[object]],
) -> list[list[object]]:
    """The GPU goals this script measures, each with its measured value and whether it was met.
    `attention_rows` are bench_attention's, `prefill_rows` bench_prefill_attention's."""
    ratio = batch1_step_s / floor_s
    goals = [
        (
            f"batch-1 graph step / floor <= {BATCH1_STEP_OVER_FLOOR_GOAL}",
            ratio,
            ratio <= BATCH1_STEP_OVER_FLOOR_GOAL,
        ),
        ("CUDA graphs vs eager at batch 1 >= 1.5x", batch1_speedup, batch1_speedup >= 1.5),
    ]
    for context, batch, _, _, fraction in attention_rows:
        wanted = DECODE_ATTENTION_GOALS.get((context, batch))
        if wanted is not None:
            name = f"decode attention {context // 1024}k x {batch} >= {wanted:.0%} of copy bw"
            goals.append((name, fraction, fraction >= wanted))
    for prompt, *_, speed in prefill_rows:
        name = f"prefill attention {prompt // 1024}k >= {PREFILL_VS_SDPA_GOAL}x torch SDPA"
        goals.append((name, speed, speed >= PREFILL_VS_SDPA_GOAL))
    return [[name, value, "met" if met else "NOT met"] for name, value, met in goals]
