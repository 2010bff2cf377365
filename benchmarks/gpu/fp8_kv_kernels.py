"""The Triton attention kernels over an FP8 (e4m3) KV cache, for `scripts/gpu_check.py`'s section "FP8 KV
cache at kernel level": the first GPU figures of the FP8 paths (their tests ran in the interpreter only).

On the GPU check's shapes (decode 4k x 32 and 32k x 8, prefill 2k and 8k; default configs), K/V drawn in
bf16 are quantized with scale FP8_KV_SCALE (`fp8_kv_cache.quantize_kv`, no value saturates) and dequantized
back. The FP8 kernel reads the codes (in the launchers' default way of applying the scales,
`paged_attention_tile.DEFAULT_FOLD_KV_SCALES`; `fp8_kv_paths` times both ways); the bf16 kernel reads the
dequantized cache: the same values, so the outputs must agree (bit for bit when the FP8 kernel dequantizes
each value; folding the scales skips rounding code * scale to bf16: FP8_MAX_REL_DIFF allows rounding).
Each row: both times, decode bandwidth counting the bytes each actually reads (2 or 1 per K/V value),
prefill TFLOP/s.

Decode runs twice over the FP8 cache, at its default tile (`decode_config(fp8_kv=True)`: 64 positions) and
at bf16's 128 (FP8_OTHER_DECODE_TILE), and at one more shape, the served steps' short contexts
(FP8_SHORT_DECODE_SHAPE): run 16 timed the 64-position tile 0.86x / 0.69x bf16's time at 4k x 32 / 32k x 8
where run 15's 128 (before the fp32 hop) made 0.93x / 0.82x, while the 8b fp8-KV server's short-context
steps were as fast as the bf16 cache's. These rows say which tile wins at which length, on one card.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from sluice.benchmarks.gpu.attention_sweep import differences
from sluice.benchmarks.gpu.gpu_benchmarks import (
    DECODE_ATTENTION_SHAPES,
    PREFILL_PROMPT_LENS,
    DecodeProblem,
    decode_problem,
    kv_read_bytes,
    prefill_problem,
    run_decode_attention,
    run_prefill_attention,
    time_kernel_s,
)
from sluice.engine.worker.attention.fp8_kv_cache import dequantize_kv, quantize_kv
from sluice.kernels.paged_decode_attention import DecodeConfig

FP8_KV_SCALE = 0.05  # K/V ~ N(0, 1): codes up to ~100, far from e4m3's 448
FP8_MAX_REL_DIFF = 1e-2  # max |fp8 - bf16 on the dequantized cache| / max |that|
FP8_OTHER_DECODE_TILE = DecodeConfig(tile_n=128, num_warps=4, num_stages=3)  # bf16's decode tile
FP8_SHORT_DECODE_SHAPE = (256, 64)  # (context, batch): a served decode step of 64 short requests
HEADERS = ["kernel", "shape", "bf16 ms", "fp8 ms", "fp8 speedup", "bf16", "fp8", "unit", "max abs diff",
           "check"]  # fmt: skip
KEYS = ("kernel", "shape", "bf16_ms", "fp8_ms", "fp8_speedup", "bf16_rate", "fp8_rate", "unit",
        "max_abs_diff", "check")  # fmt: skip


def fp8_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float = FP8_KV_SCALE
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
    """((k codes, v codes), (k, v) dequantized to the caches' dtype, kv_scales as the layers hold them)."""
    scales = (torch.tensor(scale, device=k_cache.device), torch.tensor(scale, device=k_cache.device))
    codes = (quantize_kv(k_cache, scales[0]), quantize_kv(v_cache, scales[1]))
    dequantized = tuple(dequantize_kv(c, s, k_cache.dtype) for c, s in zip(codes, scales, strict=True))
    return codes, dequantized, scales


def fp8_row(
    kernel: str,
    shape: str,
    run: Callable[..., torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    rates: Callable[[float, float], tuple[float, float]],
    unit: str,
    time_s: Callable[[Callable[[], object]], float] = time_kernel_s,
) -> list[object]:
    """One row of HEADERS: `run(k_cache=, v_cache=[, kv_scales=], out=)` on the bf16 caches' FP8 codes and
    on their dequantized copy; rates(bf16 s, fp8 s) gives the two figures in `unit`."""
    (k8, v8), (kd, vd), scales = fp8_kv(*caches)
    want = run(k_cache=kd, v_cache=vd)
    got = torch.full_like(want, math.nan)
    run(k_cache=k8, v_cache=v8, kv_scales=scales, out=got)
    max_abs, rel = differences(got, want)
    bf16_s = time_s(lambda: run(k_cache=kd, v_cache=vd, out=want))
    fp8_s = time_s(lambda: run(k_cache=k8, v_cache=v8, kv_scales=scales, out=got))
    check = "PASS" if rel <= FP8_MAX_REL_DIFF else "FAIL"  # NaN: FAIL
    check += " (bit-identical)" if max_abs == 0 else ""
    bf16_rate, fp8_rate = rates(bf16_s, fp8_s)
    return [
        kernel,
        shape,
        bf16_s * 1e3,
        fp8_s * 1e3,
        bf16_s / fp8_s,
        bf16_rate,
        fp8_rate,
        unit,
        max_abs,
        check,
    ]


def bench_fp8_kv_kernels(device: torch.device) -> list[list[object]]:
    """Decode attention at 4k x 32, 32k x 8 and FP8_SHORT_DECODE_SHAPE (the FP8 cache at its default tile,
    then at FP8_OTHER_DECODE_TILE), prefill at 2k and 8k, each over bf16 and FP8 caches."""
    rows = []
    for context, batch in (*DECODE_ATTENTION_SHAPES, FP8_SHORT_DECODE_SHAPE):
        problem = decode_problem(context, batch, device)
        kv_heads, head_dim = problem.k_cache.shape[2:]
        read = {size: kv_read_bytes(batch, context, kv_heads, head_dim, size) / 1e9 for size in (2, 1)}
        shape = f"{context // 1024}k x {batch}" if context % 1024 == 0 else f"{context} x {batch}"
        for kernel, fp8_config in (
            ("paged decode", None),
            (f"paged decode, fp8 tile {FP8_OTHER_DECODE_TILE.tile_n}", FP8_OTHER_DECODE_TILE),
        ):
            rows.append(
                fp8_row(
                    kernel, shape, fp8_decode_run(problem, fp8_config), (problem.k_cache, problem.v_cache),
                    lambda bf16_s, fp8_s, read=read: (read[2] / bf16_s, read[1] / fp8_s), "GB/s read",
                )
            )  # fmt: skip
        del problem
        torch.cuda.empty_cache()
    for prompt_len in PREFILL_PROMPT_LENS:
        problem = prefill_problem(prompt_len, device)
        tflop = problem.flops() / 1e12
        rows.append(
            fp8_row(
                "prefill", f"{prompt_len // 1024}k",
                lambda p=problem, **kw: run_prefill_attention(p, **kw),
                (problem.cache(problem.k), problem.cache(problem.v)),
                lambda bf16_s, fp8_s, tflop=tflop: (tflop / bf16_s, tflop / fp8_s),
                "TFLOP/s",
            )
        )  # fmt: skip
    return rows


def fp8_decode_run(problem: DecodeProblem, fp8_config: DecodeConfig | None) -> Callable[..., torch.Tensor]:
    """`fp8_row`'s run for a decode problem: the launcher's default config on the bf16 cache, and on the
    FP8 one (the call with kv_scales) `fp8_config` where given."""

    def run(**kwargs: object) -> torch.Tensor:
        if fp8_config is not None and "kv_scales" in kwargs:
            kwargs["config"] = fp8_config
        return run_decode_attention(problem, **kwargs)

    return run


def figures(rows: list[list[object]]) -> dict[str, object]:
    """The section's results.jsonl figures: one dict per row, keyed by KEYS."""
    return {"scale": FP8_KV_SCALE, "rows": [dict(zip(KEYS, row, strict=True)) for row in rows]}


def passed(rows: list[list[object]]) -> bool:
    return all(str(row[-1]).startswith("PASS") for row in rows)
