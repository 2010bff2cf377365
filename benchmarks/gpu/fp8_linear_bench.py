"""FP8 linears at decode batch sizes, one kernel at a time: what a decode step's linears cost on a GPU.

    python -m sluice.benchmarks.gpu.fp8_linear_bench OUT.md [--cap-s 120] [--rows 1,2,4] [--device cuda|cpu]

For each linear of the llama-3-8b and llama-3.2-1b shapes (qkv, o, gate_up, down) and each row count M:
    bf16        F.linear on the bf16 weight (the reference)
    scaled_mm   fp8_quant + row-wise torch._scaled_mm: the FP8 linears' path but where `runs_gemv`
    gemv        sluice.kernels.fp8_gemv with its default tile: the FP8 linears' path where `runs_gemv`
    gemv best   at one row, the fastest tile of a sweep (--cap-s of wall clock, shared out), every output
                checked; at more rows, that tile again
    skinny      where `runs_skinny` (2 to 64 rows, and one row past GEMV_MAX_WEIGHT): fp8_quant
                + sluice.kernels.fp8_skinny_mm with its default config (the FP8 linears' path there), and
                the fastest config of a sweep sharing the cap (from 32 rows on, wider channel blocks first)
    fused       where that default config splits K: the same with `fused_reduce` (each channel block's
                last split adds the partial sums up in the same launch, instead of a reduce launch)
    bf16 skinny sluice.kernels.skinny_mm on the bf16 weight, its default config (`--skinny-linears`: the
                float linears on the FP8 skinny launch; "bf16 skinny / bf16" against F.linear); up to 64 rows
    block 128   the same weight in 128 x 128 blocks (DeepSeek-V3 / Qwen3-FP8 checkpoints): quantize_fp8_groups
                + fp8_block_mm (sluice.kernels.fp8_block_mm); up to 8 rows also fp8_block_gemv (one launch,
                which no block linear runs since run 12), and up to 64 rows quantize_fp8_groups +
                fp8_block_skinny_mm (sluice.kernels.fp8_skinny_mm, its default config), which they run where
                `block_runs_skinny` ("block / bf16": the path they serve); not in "best fp8"
Each figure is the median of CUDA-graph replays of 20 calls in a row over enough weight copies that they do
not fit in L2, so it is the time a captured decode step spends, launch gaps included. GB/s: the weight's
bytes over that time. The fp8 outputs are compared with the bf16 product of the same e4m3 weight (block
128: of its own blocks' values).

--device cpu runs a tiny shape under the Triton interpreter, timed by wall clock
(tests/test_fp8_linear_bench.py): its figures say nothing about speed.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sluice.benchmarks.gpu.gpu_benchmarks import CALLS_PER_GRAPH, time_graph_s
from sluice.engine.loading.presets import preset_arch
from sluice.engine.worker.layers.fp8_blocks import dequantize_blocks, quantize_weight_blocks
from sluice.engine.worker.layers.fp8_linear import (
    GEMV_MAX_ROWS,
    GEMV_MAX_WEIGHT,
    SKINNY_MAX_ROWS,
    block_runs_skinny,
    quantize_weight,
    runs_gemv,
    runs_skinny,
)
from sluice.kernels.compile_target import device_sm_count
from sluice.kernels.fp8_block_gemv import MAX_ROWS as BLOCK_GEMV_ROWS
from sluice.kernels.fp8_block_gemv import fp8_block_gemv
from sluice.kernels.fp8_block_mm import fp8_block_mm, quantize_fp8_groups
from sluice.kernels.fp8_gemv import MAX_ROWS, GemvConfig, fp8_gemv, gemv_config
from sluice.kernels.fp8_quant import quantize_fp8
from sluice.kernels.fp8_skinny_mm import fp8_block_skinny_mm, fp8_skinny_mm, skinny_config
from sluice.kernels.skinny_mm import skinny_mm
from sluice.kernels.split_k import SkinnyConfig

ROWS = (1, 2, 4, 8, 16, 32, 64)
MIN_BYTES_PER_GRAPH = 256 << 20  # past an H100's / H200's 50-60 MB of L2
BLOCK = (128, 128)  # the block-wise checkpoints' weight blocks and activation groups
# First the latency options (fp8_gemv's docstring: pipelined or prefetched tiles, split K, a wider amax
# pass) on and around the tiles that won on the 8b and 1b shapes (fp8_gemv.SWEPT_TILES), then the plain
# tile grid; the sweep's wall-clock cap may cut the tail. Every one compiles for sm_90 without spilling
# (tests/test_kernels_compile.py; registers per candidate: docs/perf/kernels_sm90.md). The pipelined ones
# first: they keep 3 programs of 4 warps on an SM with 2-3 tiles each in flight, where prefetching into
# registers (~250 of 255 at 64 weight bytes a thread) keeps 2 with 2.
LATENCY_SWEEP = [
    GemvConfig(16, 512, 4, amax_k=4096, stages=3),
    GemvConfig(16, 1024, 8, amax_k=4096, stages=3),
    GemvConfig(16, 512, 4, amax_k=4096, stages=4),
    GemvConfig(8, 512, 4, amax_k=4096, stages=4),
    GemvConfig(16, 1024, 8, prefetch=True, amax_k=4096),
    GemvConfig(16, 512, 4, prefetch=True, amax_k=4096),
    GemvConfig(16, 1024, 8, amax_k=4096),
    GemvConfig(16, 512, 4, amax_k=4096),
    GemvConfig(16, 512, 4, split_k=4, amax_k=4096, stages=3),
    GemvConfig(16, 1024, 8, prefetch=True),
    GemvConfig(16, 512, 4, prefetch=True),
    GemvConfig(16, 1024, 8, split_k=2, amax_k=4096),
    GemvConfig(16, 512, 4, split_k=4, amax_k=4096),
    GemvConfig(16, 512, 4, prefetch=True, split_k=4, amax_k=4096),
    GemvConfig(8, 1024, 4, amax_k=4096, stages=3),
    GemvConfig(16, 512, 4, split_k=8, amax_k=4096),
    GemvConfig(8, 512, 4, prefetch=True, split_k=2, amax_k=4096),
]
SWEEP = LATENCY_SWEEP + [
    GemvConfig(block_n, block_k, warps)
    for block_n, block_k, warps in itertools.product((4, 8, 16, 32, 64), (128, 256, 512, 1024, 2048), (4, 8))
    if 2048 <= block_n * block_k <= 16384  # larger tiles take minutes to compile (seen on an H100)
]

SKINNY_SWEEP = [
    SkinnyConfig(block_n, 128, split_k, num_warps=4, num_stages=stages)
    for block_n, split_k, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (3, 5))
]
# Tried first from WIDE_FROM_ROWS rows on: wider channel blocks at 8 warps. Every program reads the rows' x
# slice again, BLOCK_K x M codes a K step beside BLOCK_N x BLOCK_K of weight, so at 64 rows and BLOCK_N 64
# the launch reads as many bytes of x (from L2) as of weight (run 15's 64-row 8b FP8 step, its default
# configs: about 160 MB of x reads a layer beside 218 MB of weights, which streamed at ~2.5 TB/s); BLOCK_N
# 128 halves that, 256 quarters it (cuBLAS's longest bf16 launch at 64 rows in run 15 had 256 x 64 tiles).
# sm_90, llama-3-8b at 64 rows: n128 127-131 registers, 56 KB shared at 3 stages; n256 185-215, 88 KB; no
# spills (at 4 warps n128 takes 192-202 registers).
WIDE_FROM_ROWS = 32
WIDE_SKINNY_SWEEP = [
    SkinnyConfig(block_n, 128, split_k, num_warps=8, num_stages=3)
    for block_n, split_k in itertools.product((128, 256), (1, 2, 4, 8))
]


@dataclass(frozen=True)
class Linear:
    model: str
    name: str
    out_features: int
    in_features: int


def linears(model: str) -> list[Linear]:
    arch = preset_arch(model)
    head_dim, hidden = arch.head_dim, arch.hidden_size
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * head_dim
    return [
        Linear(model, "qkv", qkv, hidden),
        Linear(model, "o", hidden, arch.num_attention_heads * head_dim),
        Linear(model, "gate_up", 2 * arch.intermediate_size, hidden),
        Linear(model, "down", hidden, arch.intermediate_size),
    ]


class Weights:
    """Copies of one random weight, bf16 and e4m3 + per-channel scales (and e4m3 + BLOCK scales), cycled
    through so that the timed calls read device memory, not L2. `block_bf16`: copy 0's block values."""

    def __init__(self, linear: Linear, device: torch.device, copies: int) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        shape = (linear.out_features, linear.in_features)
        self.bf16, self.fp8, self.block = [], [], []
        for _ in range(copies):
            weight = torch.randn(shape, generator=gen, device=device) * 0.02
            codes, scale = quantize_weight(weight)
            self.fp8.append((codes, scale))
            self.bf16.append((codes.float() * scale[:, None]).to(torch.bfloat16))  # the same values
            self.block.append(quantize_weight_blocks(weight, BLOCK))
        self.block_bf16 = dequantize_blocks(*self.block[0], BLOCK).to(torch.bfloat16)

    @staticmethod
    def copies_for(linear: Linear, device: torch.device) -> int:
        if device.type != "cuda":
            return 1
        fp8_bytes = linear.out_features * linear.in_features
        return max(1, math.ceil(MIN_BYTES_PER_GRAPH / fp8_bytes))


def time_calls_s(calls: Sequence[Callable[[], object]], device: torch.device, repeats: int = 7) -> float:
    """Seconds per call: on CUDA the median over `repeats` replays of one graph of every call in turn
    (CALLS_PER_GRAPH in all); elsewhere the wall clock of one pass."""
    count = CALLS_PER_GRAPH if device.type == "cuda" else len(calls)
    sequence = [calls[i % len(calls)] for i in range(count)]
    if device.type != "cuda":
        start = time.perf_counter()
        for call in sequence:
            call()
        return (time.perf_counter() - start) / len(sequence)
    return time_graph_s(sequence, repeats)


def _scaled_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x_q, x_scale = quantize_fp8(x)
    return torch._scaled_mm(
        x_q, codes.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16
    )


def _block(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x_q, x_scale = quantize_fp8_groups(x, BLOCK[1])
    return fp8_block_mm(x_q, x_scale, codes, scale, BLOCK, torch.bfloat16)


def _block_gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return fp8_block_gemv(x, codes, scale, BLOCK)


def _block_skinny(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x_q, x_scale = quantize_fp8_groups(x, BLOCK[1])
    return fp8_block_skinny_mm(x_q, x_scale, codes, scale, BLOCK, torch.bfloat16)


def _skinny(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, config: SkinnyConfig | None = None
) -> torch.Tensor:
    x_q, x_scale = quantize_fp8(x)
    return fp8_skinny_mm(x_q, x_scale, codes, scale, torch.bfloat16, config)


@dataclass
class Row:
    linear: Linear
    rows: int
    bf16_s: float
    scaled_mm_s: float | None
    gemv_s: float | None
    best_s: float | None = None
    best: GemvConfig | None = None
    max_rel_diff: float = 0.0
    skinny_s: float | None = None
    skinny_fused_s: float | None = None
    skinny_best_s: float | None = None
    skinny_best: SkinnyConfig | None = None
    block_s: float | None = None
    block_gemv_s: float | None = None
    block_skinny_s: float | None = None
    bf16_skinny_s: float | None = None

    def block_served_s(self) -> float | None:
        """The block linears' time as they run this step: the skinny matmul where `block_runs_skinny`, else
        the block matmul."""
        if block_runs_skinny(self.rows) and self.block_skinny_s is not None:
            return self.block_skinny_s
        return self.block_s

    def fp8_times(self) -> list[float]:
        times = (
            self.scaled_mm_s,
            self.gemv_s,
            self.best_s,
            self.skinny_s,
            self.skinny_fused_s,
            self.skinny_best_s,
        )
        return [s for s in times if s is not None]


def _rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


def bench_linear(
    linear: Linear, rows_list: Sequence[int], device: torch.device, deadline: float
) -> list[Row]:
    weights = Weights(linear, device, Weights.copies_for(linear, device))
    gen = torch.Generator(device=device).manual_seed(1)
    cuda = device.type == "cuda"
    results = []
    for rows in rows_list:
        x = torch.randn(rows, linear.in_features, generator=gen, device=device).to(torch.bfloat16)
        want = F.linear(x, weights.bf16[0])
        row = Row(
            linear, rows, time_calls_s([partial(F.linear, x, w) for w in weights.bf16], device), None, None
        )
        if cuda:
            row.max_rel_diff = _rel_diff(_scaled_mm(x, *weights.fp8[0]), want)
            row.scaled_mm_s = time_calls_s([partial(_scaled_mm, x, *w) for w in weights.fp8], device)
        if rows <= MAX_ROWS:
            row.max_rel_diff = max(row.max_rel_diff, _rel_diff(fp8_gemv(x, *weights.fp8[0]), want))
            row.gemv_s = time_calls_s([partial(fp8_gemv, x, *w) for w in weights.fp8], device)
            candidates = SWEEP if rows == 1 else [results[0].best] if results and results[0].best else []
            _sweep(row, candidates, x, weights, want, device, deadline)
        block_want = F.linear(x, weights.block_bf16)
        row.max_rel_diff = max(row.max_rel_diff, _rel_diff(_block(x, *weights.block[0]), block_want))
        row.block_s = time_calls_s([partial(_block, x, *w) for w in weights.block], device)
        if rows <= BLOCK_GEMV_ROWS:
            row.max_rel_diff = max(row.max_rel_diff, _rel_diff(_block_gemv(x, *weights.block[0]), block_want))
            row.block_gemv_s = time_calls_s([partial(_block_gemv, x, *w) for w in weights.block], device)
        if block_runs_skinny(rows):
            got = _block_skinny(x, *weights.block[0])
            row.max_rel_diff = max(row.max_rel_diff, _rel_diff(got, block_want))
            row.block_skinny_s = time_calls_s([partial(_block_skinny, x, *w) for w in weights.block], device)
        if rows <= SKINNY_MAX_ROWS:
            row.max_rel_diff = max(row.max_rel_diff, _rel_diff(skinny_mm(x, weights.bf16[0]), want))
            row.bf16_skinny_s = time_calls_s([partial(skinny_mm, x, w) for w in weights.bf16], device)
        if runs_skinny(rows, linear.out_features, linear.in_features):  # one row too past GEMV_MAX_WEIGHT
            row.max_rel_diff = max(row.max_rel_diff, _rel_diff(_skinny(x, *weights.fp8[0]), want))
            row.skinny_s = time_calls_s([partial(_skinny, x, *w) for w in weights.fp8], device)
            _time_fused_reduce(row, x, weights, want, device)
            _sweep_skinny(row, x, weights, want, device, deadline)
        results.append(row)
        print(f"[fp8_linear_bench] {table([row]).splitlines()[-1]}", file=sys.stderr, flush=True)
    return results


def _fastest(
    row: Row,
    kernel: Callable[..., torch.Tensor],
    candidates: Sequence[Any],
    default: Any,
    default_s: float,
    weights: Weights,
    want: torch.Tensor,
    device: torch.device,
    deadline: float,
) -> tuple[Any, float]:
    """The fastest of `default` (timed: default_s) and `candidates` for `kernel(*weight, config=...)`
    (on CPU only the first two), each candidate's output checked, until the deadline."""
    best, best_s = default, default_s
    for config in candidates if device.type == "cuda" else candidates[:2]:
        if time.monotonic() > deadline:
            break
        if config == default:
            continue
        try:
            got = kernel(*weights.fp8[0], config=config)
        except Exception as error:  # a tile the GPU cannot hold (shared memory): not a candidate
            print(f"[fp8_linear_bench] {row.linear.name} M={row.rows} {config}: {error}", file=sys.stderr)
            continue
        if _rel_diff(got, want) > 0.1:
            raise AssertionError(f"{row.linear} M={row.rows} {config}: output differs from bf16's")
        seconds = time_calls_s([partial(kernel, *w, config=config) for w in weights.fp8], device)
        if seconds < best_s:
            best, best_s = config, seconds
    return best, best_s


def _sweep(
    row: Row,
    candidates: Sequence[GemvConfig],
    x: torch.Tensor,
    weights: Weights,
    want: torch.Tensor,
    device: torch.device,
    deadline: float,
) -> None:
    default = gemv_config(row.linear.out_features, row.linear.in_features, device_sm_count(device))
    kernel = partial(fp8_gemv, x)
    row.best, row.best_s = _fastest(
        row, kernel, candidates, default, row.gemv_s, weights, want, device, deadline
    )


def _time_fused_reduce(
    row: Row, x: torch.Tensor, weights: Weights, want: torch.Tensor, device: torch.device
) -> None:
    """The default skinny config with `fused_reduce`, where it splits K (else there is nothing to add up)."""
    default = _default_skinny_config(row, device)
    if default.split_k == 1:
        return
    fused = replace(default, fused_reduce=True)
    row.max_rel_diff = max(row.max_rel_diff, _rel_diff(_skinny(x, *weights.fp8[0], fused), want))
    row.skinny_fused_s = time_calls_s([partial(_skinny, x, *w, fused) for w in weights.fp8], device)


def _sweep_skinny(
    row: Row, x: torch.Tensor, weights: Weights, want: torch.Tensor, device: torch.device, deadline: float
) -> None:
    default = _default_skinny_config(row, device)
    candidates = skinny_candidates(row.rows)
    row.skinny_best, row.skinny_best_s = _fastest(
        row, partial(_skinny, x), candidates, default, row.skinny_s, weights, want, device, deadline
    )


def skinny_candidates(rows: int) -> list[SkinnyConfig]:
    """The skinny sweep's configs at `rows`, in the order tried."""
    return (WIDE_SKINNY_SWEEP if rows >= WIDE_FROM_ROWS else []) + SKINNY_SWEEP


def _default_skinny_config(row: Row, device: torch.device) -> SkinnyConfig:
    """The config `fp8_skinny_mm` picks itself for the row's linear and row count on `device`."""
    linear = row.linear
    return skinny_config(linear.out_features, linear.in_features, device_sm_count(device), row.rows)


def _skinny_config(config: SkinnyConfig) -> str:
    return f"n{config.block_n} k{config.block_k} split {config.split_k}, {config.num_stages} stages"


def _us(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e6:.1f}"


def _ratio(seconds: float | None, baseline: float) -> str:
    return "" if seconds is None else f"{seconds / baseline:.2f}"


def _tile(config: GemvConfig) -> str:
    options = (
        (", prefetch" if config.prefetch else "")
        + (f", split {config.split_k}" if config.split_k > 1 else "")
        + (f", amax {config.amax_k}" if config.amax_k else "")
        + (f", stages {config.stages}" if config.stages > 1 else "")
    )
    return f"{config.block_n}x{config.block_k}, {config.num_warps} warps{options}"


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| linear | N x K | M | bf16 us | scaled_mm us | gemv us | gemv best us (tile) | skinny us "
        "| skinny fused reduce us | skinny best us (config) | best fp8 / bf16 | best fp8 GB/s | block 128 us "
        "| block gemv us | block skinny us | block / bf16 | max rel diff vs bf16 | bf16 skinny us "
        "| bf16 skinny / bf16 |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- "
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        fp8 = row.fp8_times()
        best = min(fp8) if fp8 else None
        tile = "" if row.best is None else f"{_us(row.best_s)} ({_tile(row.best)})"
        skinny = (
            "" if row.skinny_best is None else f"{_us(row.skinny_best_s)} ({_skinny_config(row.skinny_best)})"
        )
        linear = row.linear
        lines.append(
            f"| {linear.model} {linear.name} | {linear.out_features} x {linear.in_features} | {row.rows} "
            f"| {_us(row.bf16_s)} | {_us(row.scaled_mm_s)} | {_us(row.gemv_s)} "
            f"| {tile} | {_us(row.skinny_s)} | {_us(row.skinny_fused_s)} | {skinny} "
            f"| {'' if best is None else f'{best / row.bf16_s:.2f}'} "
            f"| {'' if best is None else f'{linear.out_features * linear.in_features / best / 1e9:.0f}'} "
            f"| {_us(row.block_s)} | {_us(row.block_gemv_s)} | {_us(row.block_skinny_s)} "
            f"| {_ratio(row.block_served_s(), row.bf16_s)} "
            f"| {row.max_rel_diff:.3g} | {_us(row.bf16_skinny_s)} | {_ratio(row.bf16_skinny_s, row.bf16_s)} |"
        )
    return "\n".join(lines)


def layer_table(rows: Sequence[Row]) -> str:
    """Per model and M: the four linears summed, as a decode step's layer runs them today and at best."""
    lines = [
        "| model | M | bf16 us | fp8 as served us (gemv where `runs_gemv`, skinny where `runs_skinny`, "
        "else scaled_mm) | best fp8 us "
        "| served / bf16 | best / bf16 | block 128 as served us | block / bf16 | bf16 skinny us "
        "| bf16 skinny / bf16 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_model_and_m = sorted(rows, key=lambda r: (r.linear.model, r.rows))  # stable: the linears in order
    for (model, m), group in itertools.groupby(by_model_and_m, key=lambda r: (r.linear.model, r.rows)):
        group = list(group)
        bf16 = sum(r.bf16_s for r in group)
        served_parts = [_served_s(r) for r in group]
        best_parts = [min(r.fp8_times(), default=None) for r in group]
        block_parts = [r.block_served_s() for r in group]
        served = None if None in served_parts else sum(served_parts)
        best = None if None in best_parts else sum(best_parts)
        block = None if None in block_parts else sum(block_parts)
        skinny_parts = [r.bf16_skinny_s for r in group]
        skinny = None if None in skinny_parts else sum(skinny_parts)
        lines.append(
            f"| {model} | {m} | {_us(bf16)} | {_us(served)} | {_us(best)} "
            f"| {_ratio(served, bf16)} | {_ratio(best, bf16)} | {_us(block)} | {_ratio(block, bf16)} "
            f"| {_us(skinny)} | {_ratio(skinny, bf16)} |"
        )
    return "\n".join(lines)


def _served_s(row: Row) -> float | None:
    if runs_gemv(row.rows, row.linear.out_features, row.linear.in_features):
        return row.gemv_s
    if runs_skinny(row.rows, row.linear.out_features, row.linear.in_features):
        return row.skinny_s
    return row.scaled_mm_s


def run(
    device: torch.device,
    cap_s: float,
    rows: Sequence[int] = ROWS,
    shapes: Sequence[Linear] | None = None,
    written: Callable[[str], None] | None = None,
) -> str:
    """The report of every linear of `shapes` (on CUDA the two presets' by default) at `rows`; `written`
    gets the report so far after each linear, so that a run cut short (the GPU check's step limit) keeps
    the linears it finished."""
    deadline = time.monotonic() + cap_s
    if device.type == "cuda":
        shapes = shapes or linears("llama-3-8b") + linears("llama-3.2-1b")
        rows_list = rows
        where = torch.cuda.get_device_name(device)
    else:
        shapes = shapes or [Linear("tiny", "one", 32, 256)]  # K split in two at 4 rows: the fused reduce runs
        rows_list = (1, 4)
        where = "cpu, Triton interpreter: no speed figures"
    results = []
    for index, linear in enumerate(shapes):
        # The first linear compiles the candidates (Triton caches them for the later shapes, whose N and
        # K are not constexprs): it gets half the cap, each later one an equal share of what is left.
        now = time.monotonic()
        share = now + max(deadline - now, 0.0) / (2 if index == 0 else len(shapes) - index)
        results += bench_linear(linear, rows_list, device, share)
        print(f"[fp8_linear_bench] {linear.model} {linear.name} done", file=sys.stderr, flush=True)
        if written is not None:
            written(_report(results, where, cap_s, deadline, index + 1, len(shapes)))
    return _report(results, where, cap_s, deadline, len(shapes), len(shapes))


def _report(results: list[Row], where: str, cap_s: float, deadline: float, done: int, total: int) -> str:
    progress = "" if done == total else f" Partial: {done} of {total} linears timed so far."
    return (
        f"# FP8 linears at decode batch sizes ({where})\n\n"
        f"GEMV_MAX_ROWS = {GEMV_MAX_ROWS}, GEMV_MAX_WEIGHT = {GEMV_MAX_WEIGHT}, "
        f"SKINNY_MAX_ROWS = {SKINNY_MAX_ROWS}; "
        f"tile sweeps capped at {cap_s:.0f} s "
        f"({'stopped early' if time.monotonic() > deadline else 'complete'}).{progress}\n\n"
        f"{table(results)}\n\n## Per layer (the four linears summed)\n\n{layer_table(results)}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="markdown file to write (rewritten after each linear)")
    parser.add_argument("--cap-s", type=float, default=120.0, help="wall clock for the tile sweeps")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M on CUDA, e.g. 1,2,4")
    args = parser.parse_args(argv)
    rows = [int(m) for m in args.rows.split(",")]
    out = Path(args.out)
    report = run(torch.device(args.device), args.cap_s, rows, written=out.write_text)
    out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
