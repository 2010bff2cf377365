"""Every Triton kernel compiles for the H100 (sm_90) with the constexprs its launcher picks for real
model shapes, on this GPU-less machine: scripts/compile_kernels.py records each launch from the real
launchers and compiles it ahead of time with Triton's bundled ptxas. The interpreter used by the other
kernel tests does not check `tl.dot` shapes, dtype rules or layouts; the GPU compiler does."""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sluice.benchmarks.gpu.fp8_linear_bench import LATENCY_SWEEP
from sluice.kernels.paged_decode_attention import decode_config

SCRIPT = Path(__file__).parent.parent / "scripts" / "compile_kernels.py"
KERNELS = {
    "_store_kv_kernel",
    "_decode_partition_kernel",
    "_decode_reduce_kernel",
    "_prefill_attention_kernel",
    "_merge_attention_partials_kernel",
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_rotary_store_kv_kernel",
    "_silu_and_mul_kernel",
    "_silu_and_mul_fp8_kernel",
    "_silu_and_mul_fp8_groups_kernel",
    "_fp8_quant_kernel",
    "_fp8_gemv_kernel",
    "_fp8_skinny_kernel",
    "_fp8_skinny_reduce_kernel",
    "_quantize_groups_kernel",
    "_fp8_block_mm_kernel",
    "_fp8_block_gemv_kernel",
    "_skinny_kernel",
}
# The kernels that read or write the paged KV cache, launched again over an FP8 (e4m3) cache.
CACHE_KERNELS = {
    "_store_kv_kernel",
    "_decode_partition_kernel",
    "_prefill_attention_kernel",
    "_rotary_store_kv_kernel",
}
MODEL_DTYPE_CACHE, FP8_CACHE = "FP8_KV=False", "FP8_KV=True"  # in a variant's constexprs
# The attention kernels' two ways of reading an FP8 cache (`paged_attention_tile`); always False over a
# model-dtype cache.
FOLDED, DEQUANTIZED = "FOLD_KV_SCALES=True", "FOLD_KV_SCALES=False"
# The stores' quantization: the GPU's e4m3 conversion on sm_90 over an FP8 cache, unused (False) otherwise.
HW_E4M3, NO_HW_E4M3 = "HW_E4M3=True", "HW_E4M3=False"
ATTENTION_KERNELS = {"_decode_partition_kernel", "_prefill_attention_kernel"}
# The script's configurations: four shapes in bf16, the first also in fp16 and fp32.
CONFIGS = {(shape, "bf16") for shape in ("llama-3.2-1b", "llama-3-8b", "llama-2-7b", "qwen2-0.5b")} | {
    ("llama-3.2-1b", "fp16"),
    ("llama-3.2-1b", "fp32"),
}

# 512 variants (2026-12-04; 92 of them over an FP8 cache, 33 split-KV prefill, 33 of the FP8 activation
# quantization, 97 of the batch-1 FP8 gemv) at up to a few CPU seconds each, compiled once for both tests,
# one per core at a time: 384 s one at a time on an idle 2-core AMD EPYC, two thirds of it the attention
# kernels (~2 s each: they inline three tile loops) and most of each compile Triton's own passes (ptxas
# ~15%); 345 s in the whole suite there, the other pytest worker busy beside it; more on a busier machine.
# The limits only catch a hang (ptxas): they leave a slower or busier CI machine six times that.
COMPILE_TIMEOUT_S = 2350
pytestmark = pytest.mark.timeout(2400)


@pytest.fixture(scope="module")
def compile_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    # pytest's faulthandler_timeout (5 minutes) would print every thread's stack in the middle of the
    # suite's report, as if this expected wait were a hang: the stacks wait for the compile's own limit.
    faulthandler.dump_traceback_later(COMPILE_TIMEOUT_S, file=sys.__stderr__)
    tmp_path = tmp_path_factory.mktemp("compile_kernels")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a cache
    out = tmp_path / "kernels.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)],
        env=env, capture_output=True, text=True, check=False, timeout=COMPILE_TIMEOUT_S,
    )  # fmt: skip
    return proc, json.loads(out.read_text()) if out.exists() else []


def test_every_kernel_compiles_for_sm90_in_every_shape_and_dtype(compile_run):
    proc, results = compile_run
    failed = [(r["kernel"], r["shape"], r["dtype"], r["error"]) for r in results if r["error"]]
    assert proc.returncode == 0 and not failed, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {(r["shape"], r["dtype"]) for r in results} == CONFIGS
    compiled = {(r["kernel"], r["shape"], r["dtype"]) for r in results}
    for shape in ("llama-3.2-1b", "llama-3-8b", "qwen2-0.5b"):
        assert {kernel for kernel, s, dtype in compiled if s == shape and dtype == "bf16"} >= KERNELS - {
            "_decode_reduce_kernel",  # shares its constexprs across shapes with equal head_dim
            "_fp8_gemv_kernel",  # its constexprs are the tile's and the dtype's only: across all shapes
            "_fp8_skinny_kernel",  # the same (and its split-K launches write float32 whatever the dtype)
            "_fp8_skinny_reduce_kernel",
            "_fp8_block_mm_kernel",  # the same: its tiles' and the output dtype's
            "_fp8_block_gemv_kernel",  # the same: its tile's, the blocks' and the dtype's
            "_quantize_groups_kernel",  # the same: the group width and the groups a program holds
            "_skinny_kernel",  # the same: its tile's and the dtype's
        }
    for dtype in ("bf16", "fp16", "fp32"):
        kernels = {kernel for kernel, s, d in compiled if s == "llama-3.2-1b" and d == dtype}
        assert kernels >= KERNELS - {"_fp8_skinny_kernel"} and kernels <= KERNELS
    # The decode launches' split counts (11 and 33 slices at 8 KV heads) give distinct reduce kernels,
    # and a large batch the single-split kernel that writes the output itself.
    one_b = [r for r in results if r["shape"] == "llama-3.2-1b" and r["dtype"] == "bf16"]
    assert len([r for r in one_b if r["kernel"] == "_decode_reduce_kernel"]) >= 2
    decode = [r["constexprs"] for r in one_b if r["kernel"] == "_decode_partition_kernel"]
    assert any("SINGLE_SPLIT=True" in c for c in decode) and any("SINGLE_SPLIT=False" in c for c in decode)
    # Prefill: the full 128-row tile of a long prompt and the group-sized tile of short queries.
    prefill = [r["constexprs"] for r in one_b if r["kernel"] == "_prefill_attention_kernel"]
    assert any("BLOCK_M=128" in c for c in prefill) and any("BLOCK_M=16," in c for c in prefill)
    # fbgemm_fp8's capped per-token quantization, and the norm quantizing for block FP8 (activation groups
    # of 128 columns), beside their plain variants.
    for kernel in ("_fp8_quant_kernel", "_rms_norm_kernel", "_silu_and_mul_fp8_kernel"):
        variants = [r["constexprs"] for r in one_b if r["kernel"] == kernel]
        assert any("CAPPED=True" in c for c in variants) and any("CAPPED=False" in c for c in variants)
    assert any("CAPPED=True" in r["constexprs"] for r in results if r["kernel"] == "_fp8_gemv_kernel")
    norms = [r["constexprs"] for r in one_b if r["kernel"] == "_rms_norm_kernel"]
    assert any("GROUP_SIZE=128" in c for c in norms) and any("GROUP_SIZE=0" in c for c in norms)
    assert all(r["registers"] > 0 and r["registers"] <= 255 for r in results)
    # The one-row FP8 sweep's latency candidates (pipelined or prefetched tiles, split K with its reduce, a
    # wider amax pass), each compiled in bf16 without spilling registers: one that spills is no candidate.
    gemv = [r for r in results if r["kernel"] == "_fp8_gemv_kernel" and r["dtype"] == "bf16"]
    for config in LATENCY_SWEEP:
        tile = (
            f"BLOCK_M=1, BLOCK_N={config.block_n}, BLOCK_K={config.block_k}, AMAX_K={config.amax_tile_k(1)}, "
            f"DYNAMIC=True, PREFETCH={config.prefetch}, SPLIT_K={config.split_k}, STAGES={config.stages}, "
            "CAPPED=False, PDL=True, PREFETCH_BYTES="
        )
        variants = [r for r in gemv if tile in r["constexprs"]]
        assert variants and all(r["local_bytes"] == 0 for r in variants), (config, variants)
    # Its split-K launches sum their partials in the skinny kernel's reduce, at one row.
    assert any(r["kernel"] == "_fp8_skinny_reduce_kernel" and "M=1," in r["constexprs"] for r in one_b)
    # The block-scaled skinny launches (128 x 128 blocks), split K, and their reduce of scaled partials.
    skinny = [r["constexprs"] for r in one_b if r["kernel"] == "_fp8_skinny_kernel"]
    assert any("SCALE_BLOCK_N=128" in c and "SPLIT_K=1" not in c for c in skinny)
    assert any("SCALE_BLOCK_N=0" in c for c in skinny)
    reduces = [r["constexprs"] for r in one_b if r["kernel"] == "_fp8_skinny_reduce_kernel"]
    assert any("SCALED=False" in c for c in reduces) and any("SCALED=True" in c for c in reduces)
    # The kernel_bench's fused-reduce candidate (split K added up by each channel block's last split, an
    # acq_rel counter), compiled without spilling beside the two-launch variants.
    fused = [r for r in one_b if "FUSED_REDUCE=True" in r["constexprs"]]
    assert fused and all("SPLIT_K=1," not in r["constexprs"] and r["local_bytes"] == 0 for r in fused), fused
    # The float skinny launch of down_proj on [gate | up] rows (SiLU-and-mul in its loads), without spills.
    gated = [r for r in one_b if r["kernel"] == "_skinny_kernel" and "GATED_D=0," not in r["constexprs"]]
    assert gated and all("GATED_D=8192," in r["constexprs"] and r["local_bytes"] == 0 for r in gated), gated
    # ... and its one-row launch with the RMSNorm (with and without the residual add) in its loads.
    normed = [
        r["constexprs"]
        for r in one_b
        if r["kernel"] == "_skinny_kernel" and "NORM_K=2048," in r["constexprs"]
    ]
    assert {"HAS_RESIDUAL=True" in c for c in normed} == {True, False}, normed
    assert all(r["local_bytes"] == 0 for r in one_b if r["kernel"] == "_skinny_kernel")
    # The one-row FP8 launches of down_proj on [gate | up] (SiLU-and-mul and the codes in their loads:
    # `fuse_silu_fp8`), per token and static, on the skinny launch and the gemv, without spills.
    fp8_gated = [
        r
        for r in one_b
        if r["kernel"] in ("_fp8_skinny_kernel", "_fp8_gemv_kernel") and "GATED_D=8192" in r["constexprs"]
    ]
    kinds = {(r["kernel"], "DYNAMIC=True" in r["constexprs"]) for r in fp8_gated}
    assert kinds == {(k, d) for k in ("_fp8_skinny_kernel", "_fp8_gemv_kernel") for d in (True, False)}
    assert all(r["local_bytes"] == 0 for r in fp8_gated), fp8_gated
    assert f"{len(results)} of {len(results)} kernel variants compiled for sm_90" in proc.stdout


def test_every_half_precision_dot_reaches_the_tensor_cores(compile_run):
    """The tensor-core instructions in each variant's PTX: every bf16 / fp16 attention variant's `tl.dot`
    lowers to them; the prefill's 128-row tile (long prompts, the bulk of prefill FLOPs), the FP8 GEMMs'
    64-row tiles and the skinny launches' 64-channel ones to Hopper's warpgroup wgmma, the decode kernel's
    GQA group (<= 16 rows) and the 16-row tiles to mma.sync; fp32 attention and fp32 skinny products
    ("ieee") and the kernels without a dot to neither."""
    proc, results = compile_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def ops(kernel: str, dtypes: tuple[str, ...], constexpr: str = "") -> set[tuple[int, int]]:
        """{(wgmma, mma.sync)} over the kernel's variants in `dtypes` whose constexprs hold `constexpr`."""
        return {
            (r["wgmma"], r["mma_sync"])
            for r in results
            if r["kernel"] == kernel and r["dtype"] in dtypes and constexpr in r["constexprs"]
        }

    half = ("bf16", "fp16")
    long_prefill = ops("_prefill_attention_kernel", half, "BLOCK_M=128,")
    assert long_prefill and all(wgmma > 0 and mma == 0 for wgmma, mma in long_prefill)
    for small in (
        ops("_prefill_attention_kernel", half, "BLOCK_M=16,"),
        ops("_decode_partition_kernel", half),
    ):
        assert small and all(wgmma == 0 and mma > 0 for wgmma, mma in small)
    gemms = ("_fp8_block_mm_kernel", "_fp8_skinny_kernel", "_skinny_kernel")
    for gemm in (ops(gemms[0], half, "BLOCK_M=64,"), ops(gemms[1], half), ops(gemms[2], half)):
        assert gemm and all(wgmma > 0 for wgmma, _ in gemm)
    for kernel in (*ATTENTION_KERNELS, "_skinny_kernel"):
        assert ops(kernel, ("fp32",)) == {(0, 0)}
    for kernel in KERNELS - ATTENTION_KERNELS - set(gemms):
        assert ops(kernel, ("bf16", "fp16", "fp32")) == {(0, 0)}, kernel


def test_e4m3_values_are_made_and_read_with_the_gpus_own_conversions(compile_run):
    """What the interpreted kernel tests cannot show: on sm_90 every kernel that quantizes to e4m3 makes
    the codes with the GPU's conversion (HW_E4M3: `cvt.rn.satfinite.e4m3x2.f32`, two values an
    instruction), and the attention kernels read an FP8 cache with the GPU's e4m3 upcast and never convert
    fp16 to bf16 one value at a time (`cvt.bf16.f16`: the codes reach bf16 through fp32)."""
    proc, results = compile_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    quantizing = [r for r in results if HW_E4M3 in r["constexprs"].split(", ")]
    assert {r["kernel"] for r in quantizing} == {
        "_store_kv_kernel",
        "_rotary_store_kv_kernel",
        "_rms_norm_kernel",
        "_silu_and_mul_fp8_kernel",
        "_silu_and_mul_fp8_groups_kernel",
        "_fp8_quant_kernel",
        "_quantize_groups_kernel",
        "_fp8_block_gemv_kernel",
        "_fp8_skinny_kernel",  # its one-row launch with the norm in its loads (`fp8_normed_skinny_mm`)
    }
    assert all("cvt.rn.satfinite.e4m3x2.f32" in r["conversions"] for r in quantizing)
    fp8_reads = [r for r in results if r["kernel"] in ATTENTION_KERNELS and FP8_CACHE in r["constexprs"]]
    assert fp8_reads and all("cvt.rn.f16x2.e4m3x2" in r["conversions"] for r in fp8_reads)
    assert not [r for r in fp8_reads if "cvt.bf16.f16" in r["conversions"]]


# What a kernel launched with PDL may load before its wait, never written in a step: the norm's weight, and
# the one-row FP8 gemv's first weight tile when its config prefetches it (PREFETCH=True).
LOADS_BEFORE_WAIT = {"_rms_norm_kernel": "", "_fp8_gemv_kernel": "PREFETCH=True"}
PREFETCHING = {"_fp8_skinny_kernel", "_fp8_gemv_kernel", "_skinny_kernel"}  # their weights' first lines


def test_every_kernel_waits_for_the_kernel_before_it_before_it_touches_activations(compile_run):
    """Programmatic dependent launch on sm_90 (`sluice.kernels.dependent_launch`), what the interpreter
    never runs: every variant launches with it (`launch_pdl`, the PDL constexpr) and waits for the kernel
    before it (`griddepcontrol.wait`) before any store or atomic and before any load but the weights of
    LOADS_BEFORE_WAIT; the FP8 linears ask L2 for their weight rows before it (`prefetch.global.L2`), the
    others ask for nothing. A load of activations above the wait would read the previous kernel's output
    while it is being written."""
    proc, results = compile_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(r["pdl"] and "PDL=True" in r["constexprs"].split(", ") for r in results)
    for r in results:
        loads, writes, prefetches = r["before_wait"]
        allowed = LOADS_BEFORE_WAIT.get(r["kernel"])
        assert writes == 0, r
        assert loads == 0 or (allowed is not None and allowed in r["constexprs"]), r
        prefetching = r["kernel"] in PREFETCHING and "PREFETCH_BYTES=0" not in r["constexprs"]
        assert (prefetches > 0) == prefetching, r
    assert [r for r in results if r["kernel"] == "_fp8_gemv_kernel" and r["before_wait"][0] > 0]
    eight_b = [r for r in results if r["shape"] == "llama-3-8b" and r["kernel"] in PREFETCHING]
    assert eight_b and all(r["before_wait"][2] > 0 for r in eight_b)


def test_every_kv_cache_launch_compiles_over_an_fp8_cache_too(compile_run):
    """Each variant of a cache kernel over a model-dtype cache has its twin over an FP8 (e4m3) cache in
    the same shape and model dtype: the same constexprs but FP8_KV=True (the scale pointers, None
    constexprs on the model-dtype path, are real float32 pointers there), the stores' HW_E4M3=True (the
    GPU's conversion; False over a model-dtype cache, where nothing is quantized) and the decode kernel's
    tile `decode_config`'s for an FP8 cache; the attention kernels' twins come in both ways of applying the
    scales (FOLD_KV_SCALES True and False; always False without FP8)."""
    proc, results = compile_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    model_dtype, fp8 = _cache_variants(results, MODEL_DTYPE_CACHE), _cache_variants(results, FP8_CACHE)
    assert {kernel for kernel, *_ in fp8} == CACHE_KERNELS
    assert {(shape, dtype) for _, shape, dtype, _ in fp8} == CONFIGS
    attention = [v for v in model_dtype if v[0] in ATTENTION_KERNELS]
    assert [v for v in fp8 if v[0] not in ATTENTION_KERNELS] == [v for v in model_dtype if v not in attention]
    twins = sorted(_fp8_twin(v) for v in attention)
    assert twins != attention  # the 2-byte dtypes' decode tiles differ
    assert _cache_variants(results, FP8_CACHE, FOLDED) == twins
    assert _cache_variants(results, FP8_CACHE, DEQUANTIZED) == twins
    assert not _cache_variants(results, MODEL_DTYPE_CACHE, FOLDED)
    stores = [v for v in fp8 if v[0] not in ATTENTION_KERNELS]
    assert stores == _cache_variants(results, FP8_CACHE, HW_E4M3)
    assert stores == _cache_variants(results, MODEL_DTYPE_CACHE, NO_HW_E4M3)  # the attention ones have none
    assert not [r for r in results if FP8_CACHE in r["constexprs"] and r["error"]]


def _fp8_twin(variant: tuple[str, str, str, str]) -> tuple[str, str, str, str]:
    """A model-dtype cache variant as its FP8-cache twin is recorded: the decode kernel at
    `decode_config`'s tile for an FP8 cache."""
    kernel, shape, dtype, constexprs = variant
    if kernel != "_decode_partition_kernel":
        return variant
    values = dict(c.split("=", 1) for c in constexprs.split(", "))
    model_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    tile = decode_config(int(values["HEAD_DIM"]), model_dtype, fp8_kv=True).tile_n
    return kernel, shape, dtype, constexprs.replace(f"TILE_N={values['TILE_N']}", f"TILE_N={tile}")


def _cache_variants(results: list[dict], *flags: str) -> list[tuple[str, str, str, str]]:
    """(kernel, shape, dtype, constexprs less the cache dtype and the FP8 read's path) of the variants
    whose constexprs hold every one of `flags`, sorted."""
    dropped = {MODEL_DTYPE_CACHE, FP8_CACHE, FOLDED, DEQUANTIZED, HW_E4M3, NO_HW_E4M3}
    dropped |= {"k_scale_ptr=None", "v_scale_ptr=None"}
    return sorted(
        (
            r["kernel"],
            r["shape"],
            r["dtype"],
            ", ".join(c for c in r["constexprs"].split(", ") if c not in dropped),
        )
        for r in results
        if set(flags) <= set(r["constexprs"].split(", "))
    )


def test_refuses_to_run_under_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    assert "compile_kernels: unset TRITON_INTERPRET" in proc.stderr


def test_a_serving_workload_compiles_one_prefill_variant_and_a_decode_variant_per_split_shape():
    """Triton specializes integer arguments by value class (== 1, divisible by 16) unless told not to; the
    batch size, tile count, split count and block-table width change every step, so without
    do_not_specialize a server compiles (and stalls for seconds) whenever a batch hits a new class (5
    prefill variants for the script's 9 batches before). Only the constexprs may tell launches apart: one
    prefill tile, single split or not (prefill and decode), and the decode reduce kernel's power-of-two
    split pad; the prefill partials' merge takes any split count in one variant."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--serving-variants"],
        env=env, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    variants = json.loads(proc.stdout)
    # Two of the nine prefill batches (1 x 256 and 3 x 40 blocks) are few tiles over long contexts: split.
    assert variants["_prefill_attention_kernel"] == {"launches": 9, "variants": 2}
    assert variants["_merge_attention_partials_kernel"] == {"launches": 2, "variants": 1}
    assert variants["_decode_partition_kernel"] == {"launches": 18, "variants": 2}
    reduce = variants["_decode_reduce_kernel"]
    assert reduce["launches"] >= 6 and reduce["variants"] <= 6  # SPLITS_PAD: 2, 4, ..., 64
