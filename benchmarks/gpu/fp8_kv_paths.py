"""The Triton attention kernels over an FP8 (e4m3) KV cache in each way of applying its scales, against bf16.

    python -m sluice.benchmarks.gpu.fp8_kv_paths OUT.md                  # CUDA, the shapes below, < 60 s
    python -m sluice.benchmarks.gpu.fp8_kv_paths OUT.md --device cpu --tiny   # TRITON_INTERPRET=1, seconds

`paged_attention_tile` reads an FP8 cache two ways (FOLD_KV_SCALES): "fold" converts the codes straight to the
dot's dtype and applies the per-layer scales to the scores and the output once; "dequantize" turns each value
into (float32(code) * scale).to(bf16) before the dots (the earlier path). Each row times one kernel on one
shape over a bf16 cache and over an FP8 cache read each way (`time_kernel_s`: calls captured in one CUDA
graph, no host time; the median of the replays), the FP8 rows' time as a speedup over bf16 (bf16 ms / fp8 ms:
above 1 is faster) and fold over dequantize. K/V are drawn in bf16 (unit normal) and quantized with
FP8_KV_SCALE (no value saturates); the bf16 kernel reads the dequantized cache, so all three attend the same
values. Checks: every output against the PyTorch reference on the dequantized cache (max |diff| / max
|reference| <= FP8_MAX_REL_DIFF, INTERPRETED_MAX_REL_DIFF on CPU; an unwritten, NaN-poisoned element fails)
and, with unit scales on the same codes, fold and dequantize bit for bit equal (they must be: nothing is
rounded differently).

Shapes: decode at the GPU check's 4k x 32 and 32k x 8 (llama-3.2-1b heads: 32 query / 8 KV, head_dim 64)
and at llama-3-8b's serving shape (64 sequences of 256 positions, 32 query / 8 KV heads, head_dim 128:
128-token prompts with 128 output tokens end there), prefill of one 2k prompt (llama-3.2-1b heads).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.benchmarks.gpu.attention_sweep import differences
from sluice.benchmarks.gpu.fp8_kv_kernels import FP8_KV_SCALE, FP8_MAX_REL_DIFF, fp8_kv
from sluice.benchmarks.gpu.gpu_benchmarks import (
    BLOCK_SIZE,
    decode_step_inputs,
    prefill_step_inputs,
    time_kernel_s,
)
from sluice.benchmarks.gpu.markdown_table import markdown_table
from sluice.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
from sluice.kernels.prefill_attention import prefill_attention, prefill_attention_reference

HEADERS = ["kernel", "shape", "bf16 ms", "fp8 fold ms", "fp8 dequantize ms", "fold vs bf16",
           "dequantize vs bf16", "fold vs dequantize", "max rel diff", "unit scales: fold == dequantize",
           "check"]  # fmt: skip
PATHS = (True, False)  # fold_kv_scales of the two FP8 columns: fold, dequantize
# The CPU mode's allowance: Triton's interpreter rounds fp32 -> bf16 by truncation (numpy has no bfloat16),
# for P, the outputs and dequantize's values, which about doubles a GPU's rounding error.
INTERPRETED_MAX_REL_DIFF = 2.5e-2


@dataclass(frozen=True)
class AttentionShape:
    """One launch: `batch` sequences of `context` positions (decode: one query each; prefill: one prompt
    of `context` tokens, batch 1)."""

    kernel: str  # "decode" or "prefill"
    label: str
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = (
    AttentionShape("decode", "4k x 32", 32, 4096, 32, 8, 64),
    AttentionShape("decode", "32k x 8", 8, 32768, 32, 8, 64),
    AttentionShape("decode", "llama-3-8b serving: 256 x 64", 64, 256, 32, 8, 128),
    AttentionShape("prefill", "2k", 1, 2048, 32, 8, 64),
)
# --tiny: the same kernels and default tiles on shapes the interpreter runs in seconds (GQA 4, a decode
# with a partial last block, a prefill longer than one 64-position tile).
TINY_SHAPES = (
    AttentionShape("decode", "tiny 40 x 3", 3, 40, 8, 2, 16),
    AttentionShape("prefill", "tiny 70", 1, 70, 8, 2, 16),
)


@dataclass(frozen=True)
class Case:
    """A shape's inputs: `run(k_cache, v_cache, kv_scales, fold, out)` launches the kernel,
    `reference(k_cache, v_cache, kv_scales)` is its PyTorch version; caches in bf16."""

    run: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def make_case(shape: AttentionShape, device: torch.device, seed: int = 0) -> Case:
    """Random bf16 q and K/V (unit normal) on disjoint blocks laid out in order."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).to(torch.bfloat16)

    scale = shape.head_dim**-0.5
    num_blocks = shape.batch * -(-shape.context // BLOCK_SIZE)
    k_cache, v_cache = (randn(num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim) for _ in range(2))
    if shape.kernel == "decode":
        md = decode_step_inputs(shape.batch, shape.context, BLOCK_SIZE, device).metadata
        q = randn(shape.batch, shape.num_heads, shape.head_dim)
        tables = (md.block_tables, md.seq_lens)

        def run(k_cache, v_cache, kv_scales=None, fold=None, out=None):
            return paged_decode_attention(
                q, k_cache, v_cache, *tables, scale, md.max_seq_len, out=out, kv_scales=kv_scales,
                fold_kv_scales=fold,
            )  # fmt: skip

        def reference(k_cache, v_cache, kv_scales):
            return paged_decode_attention_reference(q, k_cache, v_cache, *tables, scale, kv_scales=kv_scales)

        return Case(run, reference, k_cache, v_cache)
    md = prefill_step_inputs(shape.context, BLOCK_SIZE, device).metadata
    q = randn(shape.context, shape.num_heads, shape.head_dim)
    tables = (md.query_start_loc, md.seq_lens, md.block_tables)

    def run(k_cache, v_cache, kv_scales=None, fold=None, out=None):
        return prefill_attention(
            q, k_cache, v_cache, *tables, md.max_query_len, scale, out=out, kv_scales=kv_scales,
            fold_kv_scales=fold,
        )  # fmt: skip

    def reference(k_cache, v_cache, kv_scales):
        return prefill_attention_reference(q, k_cache, v_cache, *tables, scale, kv_scales=kv_scales)

    return Case(run, reference, k_cache, v_cache)


def measure(
    shape: AttentionShape,
    case: Case,
    time_s: Callable[[Callable[[], object]], float],
    max_rel_diff: float = FP8_MAX_REL_DIFF,
) -> list[object]:
    """One row of HEADERS for `shape`; outputs off the reference by more than `max_rel_diff` fail it."""
    (k8, v8), (kd, vd), scales = fp8_kv(case.k_cache, case.v_cache, FP8_KV_SCALE)
    expected = case.reference(k8, v8, scales)
    outs = [case.run(kd, vd, out=torch.full_like(expected, math.nan))]
    outs += [case.run(k8, v8, scales, fold, torch.full_like(expected, math.nan)) for fold in PATHS]
    relative = [differences(out, expected)[1] for out in outs]  # NaN: an unwritten (poisoned) element
    worst = math.nan if any(math.isnan(r) for r in relative) else max(relative)
    unit = (torch.ones_like(scales[0]), torch.ones_like(scales[1]))
    unit_equal = torch.equal(*(case.run(k8, v8, unit, fold) for fold in PATHS))
    bf16_s = time_s(lambda: case.run(kd, vd, out=outs[0]))
    fold_s, dequantize_s = (
        time_s(lambda fold=fold, out=out: case.run(k8, v8, scales, fold, out))
        for fold, out in zip(PATHS, outs[1:], strict=True)
    )
    check = "PASS" if worst <= max_rel_diff and unit_equal else "FAIL"  # NaN: FAIL
    return [
        shape.kernel, shape.label, f"{bf16_s * 1e3:.4g}", f"{fold_s * 1e3:.4g}", f"{dequantize_s * 1e3:.4g}",
        f"{bf16_s / fold_s:.3f}x", f"{bf16_s / dequantize_s:.3f}x", f"{dequantize_s / fold_s:.3f}x",
        f"{worst:.2e}", "yes" if unit_equal else "NO", check,
    ]  # fmt: skip


def wall_time_s(fn: Callable[[], object], iters: int = 1) -> float:
    """Median wall-clock seconds per call (the CPU mode: interpreter times, no meaning for a GPU)."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(shapes: tuple[AttentionShape, ...], device: torch.device) -> list[list[object]]:
    time_s, max_rel_diff = (time_kernel_s, FP8_MAX_REL_DIFF)
    if device.type != "cuda":
        time_s, max_rel_diff = wall_time_s, INTERPRETED_MAX_REL_DIFF
    rows = []
    for shape in shapes:
        rows.append(measure(shape, make_case(shape, device), time_s, max_rel_diff))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def report(rows: list[list[object]], device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton's interpreter"
    return (
        f"FP8-KV attention kernels, fold vs dequantize vs a bf16 cache ({where}; FP8_KV_SCALE "
        f"{FP8_KV_SCALE}; speedups are bf16 ms / fp8 ms):\n\n" + markdown_table(HEADERS, rows) + "\n"
    )


def passed(rows: list[list[object]]) -> bool:
    return all(row[-1] == "PASS" for row in rows)


def main(out_path: str | Path, device: str = "cuda", tiny: bool = False) -> int:
    """Runs SHAPES (TINY_SHAPES with `tiny`) on `device`, prints the table and writes it to `out_path`;
    0 when every row passes its checks, 1 otherwise."""
    target = torch.device(device)
    if target.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("device: cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    rows = bench(TINY_SHAPES if tiny else SHAPES, target)
    text = report(rows, target)
    print(text)
    Path(out_path).write_text(text)
    return 0 if passed(rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the markdown file to write")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (under TRITON_INTERPRET=1)")
    parser.add_argument("--tiny", action="store_true", help="small shapes, for the interpreter")
    args = parser.parse_args()
    sys.exit(main(args.out, args.device, args.tiny))
