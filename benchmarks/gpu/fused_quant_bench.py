"""RMSNorm and SiLU-and-mul with the FP8 activation quantization fused in, against the two launches they
replace: what the fusion saves per decoder layer of an FP8 model on a GPU.

    python -m sluice.benchmarks.gpu.fused_quant_bench OUT.md [--device cuda|cpu] [--rows 1,16,64,256,8192]

For the llama-3-8b and llama-3.2-1b shapes, bf16, and each row count M:
    norm   rms_norm (with the residual add) then fp8_quant   vs  rms_norm_fp8_quant      [M, hidden]
    silu   silu_and_mul then fp8_quant                       vs  silu_and_mul_fp8_quant  [M, 2 x intermediate]
per token each also launched another way, "fused, other launch":
    norm   `rms_norm_fp8_quant(warps=WIDE_NORM_WARPS)`: 32 warps a row where the default (`norm_warps`)
           has 8 on both shapes' rows: vLLM's fused add-RMSNorm FP8 launch below 256 tokens; its bits
           are checked against `rms_norm(warps=WIDE_NORM_WARPS)` then fp8_quant (another warp count sums
           a row's squares in another order)
    silu   `silu_and_mul_fp8_quant(tile=LONG_ROW_TILE)`: a program of 16 warps holds 4,096 columns at a
           time (its first tile kept, the others made twice: amax, then codes; sm_90: 38 registers on the
           8b's rows, three programs an SM) where the default's one program of 1,024 threads holds the
           whole row (42 registers, one an SM): long prompts' candidate
per token (the per-channel FP8 linears' dynamic activations), and per group of 128 columns (block FP8's:
`quantize_fp8_groups` unfused, the kernels' `group_size` fused); "per layer" adds two norms and one silu,
what a decoder layer runs (input and post-attention norms, the MLP's activation). Each figure is the median of
CUDA-graph replays of 20 calls in a row (`time_kernel_s`: no host time, launch gaps included). Every row first
checks that both ways write the same codes and scales, bit for bit (the tests' claim, on this device).

--device cpu runs a tiny shape under the Triton interpreter, timed by wall clock: no speed figures
(tests/test_fused_quant_bench.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sluice.benchmarks.gpu.gpu_benchmarks import time_kernel_s
from sluice.benchmarks.gpu.markdown_table import markdown_table
from sluice.engine.loading.presets import preset_arch
from sluice.kernels.fp8_block_mm import quantize_fp8_groups
from sluice.kernels.fp8_quant import quantize_fp8
from sluice.kernels.rms_norm import rms_norm, rms_norm_fp8_quant
from sluice.kernels.silu_and_mul import silu_and_mul, silu_and_mul_fp8_quant

# Decode steps, and a prefill step's 8,192 (run 15's FP8 prompt burst: 8,065 tokens in one step, its fused
# SiLU-and-mul ~530 us a launch, three times the bf16 server's `silu_and_mul` on as many tokens; run 12
# had the fused one already 1.09x the two launches at 256 rows).
ROWS = (1, 16, 64, 256, 8192)
MODELS = ("llama-3-8b", "llama-3.2-1b")
EPS = 1e-5
GROUP_SIZE = 128  # DeepSeek-V3 / Qwen3-FP8's activation groups (32 on the CPU mode's tiny shape)
LONG_ROW_TILE = 4096  # the tiled candidate's columns a program (64 on the CPU mode's tiny shape)
WIDE_NORM_WARPS = 32  # the norm's other launch: a row on 1,024 threads

Outputs = tuple[torch.Tensor, torch.Tensor]  # (codes, scales)


@dataclass(frozen=True)
class Row:
    model: str
    op: str  # "norm" or "silu"
    scales: str  # "token" or "group N"
    rows: int
    unfused_s: float
    fused_s: float
    same_bits: bool
    other_s: float | None = None  # per token: the fused launch the other way (`_calls`)
    other: str = ""  # which way, e.g. "tile 4096" or "32 warps"


def _same_bits(a: Outputs, b: Outputs) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(
        a[1].view(torch.int32), b[1].view(torch.int32)
    )


def _time_s(call: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        return time_kernel_s(call)
    call()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _calls(
    op: str, group: int | None, rows: int, hidden: int, intermediate: int, tile: int, device: torch.device
):
    """(unfused, fused, other) for `op` at `rows` rows on fresh random bf16 inputs, per token (`group`
    None) or per group of `group` columns: each returns (codes, scales); other, per token only (else None),
    (which, call, the unfused launches it must equal, None where they are `unfused`) for the fused launch
    the other way: the norm on WIDE_NORM_WARPS warps, the SiLU-and-mul in `tile`-wide tiles."""
    gen = torch.Generator().manual_seed(rows)

    def quantize(x: torch.Tensor) -> Outputs:
        return quantize_fp8(x) if group is None else quantize_fp8_groups(x, group)

    if op == "norm":
        x, residual = (torch.randn(rows, hidden, generator=gen).bfloat16().to(device) for _ in range(2))
        weight = (1 + torch.randn(hidden, generator=gen) / 4).bfloat16().to(device)
        wide = (
            f"{WIDE_NORM_WARPS} warps",
            lambda: rms_norm_fp8_quant(x, weight, EPS, residual, warps=WIDE_NORM_WARPS)[:2],
            lambda: quantize(rms_norm(x, weight, EPS, residual, warps=WIDE_NORM_WARPS)[0]),
        )
        return (
            lambda: quantize(rms_norm(x, weight, EPS, residual)[0]),
            lambda: rms_norm_fp8_quant(x, weight, EPS, residual, group_size=group)[:2],
            wide if group is None else None,
        )
    gate_up = torch.randn(rows, 2 * intermediate, generator=gen).bfloat16().to(device)
    tiled = f"tile {tile}", lambda: silu_and_mul_fp8_quant(gate_up, tile=tile), None
    return (
        lambda: quantize(silu_and_mul(gate_up)),
        lambda: silu_and_mul_fp8_quant(gate_up, group_size=group),
        tiled if group is None else None,
    )


def bench(device: torch.device, rows_list: Sequence[int]) -> list[Row]:
    shapes = (
        [(name, preset_arch(name).hidden_size, preset_arch(name).intermediate_size) for name in MODELS]
        if device.type == "cuda"
        else [("tiny", 96, 160)]
    )
    groups = (None, GROUP_SIZE if device.type == "cuda" else 32)
    tile = LONG_ROW_TILE if device.type == "cuda" else 64
    results = []
    for model, hidden, intermediate in shapes:
        for group in groups:
            scales = "token" if group is None else f"group {group}"
            for op in ("norm", "silu"):
                for rows in rows_list:
                    unfused, fused, other = _calls(op, group, rows, hidden, intermediate, tile, device)
                    which, other_call, other_want = other or ("", None, None)
                    want = unfused()
                    same = _same_bits(want, fused())
                    if other_call is not None:
                        same &= _same_bits(want if other_want is None else other_want(), other_call())
                    timed = _time_s(unfused, device), _time_s(fused, device)
                    other_s = None if other_call is None else _time_s(other_call, device)
                    results.append(Row(model, op, scales, rows, *timed, same, other_s, which))
        print(f"[fused_quant_bench] {model} done", file=sys.stderr, flush=True)
    return results


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f}"


def report(results: Sequence[Row], where: str) -> str:
    rows = [
        [
            r.model,
            r.op,
            r.scales,
            r.rows,
            _us(r.unfused_s),
            _us(r.fused_s),
            f"{r.fused_s / r.unfused_s:.2f}",
            "" if r.other_s is None else f"{_us(r.other_s)} ({r.other})",
            r.same_bits,
        ]
        for r in results
    ]
    by_key = {(r.model, r.op, r.scales, r.rows): r for r in results}
    layer_rows = []
    for model, scales, m in dict.fromkeys((r.model, r.scales, r.rows) for r in results):
        norm, silu = by_key[(model, "norm", scales, m)], by_key[(model, "silu", scales, m)]
        unfused = 2 * norm.unfused_s + silu.unfused_s
        fused = 2 * norm.fused_s + silu.fused_s
        layer_rows.append(
            [model, scales, m, _us(unfused), _us(fused), _us(unfused - fused), f"{fused / unfused:.2f}"]
        )
    headers = ["model", "op", "scales", "rows", "unfused us", "fused us", "fused / unfused"]
    headers += ["fused, other launch us (which)", "same bits"]
    layer_headers = ["model", "scales", "rows", "unfused us", "fused us", "saved us", "fused / unfused"]
    return (
        f"# FP8 activation quantization fused into RMSNorm / SiLU-and-mul ({where})\n\n"
        f"{markdown_table(headers, rows)}\n\n"
        f"## Per decoder layer (two norms and one silu)\n\n{markdown_table(layer_headers, layer_rows)}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Writes the report to OUT; 0 when both ways wrote the same bits in every row, 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="markdown file to write")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M on CUDA")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("device: cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if device.type == "cuda":
        results, where = bench(device, [int(m) for m in args.rows.split(",")]), torch.cuda.get_device_name()
    else:
        results, where = bench(device, (1, 4)), "cpu, Triton interpreter: no speed figures"
    text = report(results, where)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0 if all(r.same_bits for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
