"""The GPU check's kernel test files (`scripts/gpu_check.sh`'s kernel_tests step, one pytest per file).

Each entry is a file and, where only part of it belongs on the GPU, a pytest `-k` expression carried with
it: `scripts/gpu_check.py --print-kernel-tests` prints one entry a line, its pytest arguments separated by
tabs, and `SLUICE_GPU_CHECK_KERNEL_TESTS="file ..."` (`--kernel-tests`) keeps only the files it names.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

KNOB = "SLUICE_GPU_CHECK_KERNEL_TESTS"


@dataclass(frozen=True)
class KernelTestFile:
    path: str  # from the repository root
    keyword: str | None = None  # pytest -k: the tests of the file that run on the GPU

    def pytest_args(self) -> list[str]:
        return [self.path] if self.keyword is None else [self.path, "-k", self.keyword]

    def line(self) -> str:
        return "\t".join(self.pytest_args())


# The longest first: the step runs eight files at once (scripts/gpu_check.sh, KERNEL_TEST_JOBS), so these
# start together and the short ones fill in behind them. Seconds each in run 16 (an H200, four at once):
# the FP8 cache 101, attention 68, model parity 52, the gated and normed FP8 linears 49 and 47, the fused
# FP8 quantization 46, skinny_mm 37, fp8_gemv 33, store 32, split-KV prefill 31, the rest 4-20: ~570 s of
# files, ~145 s on four, bound by the longest on eight. The decode reduce fused into the split kernel goes
# first: run 16 cut it at the step's limit, the last file then, so it has never run on a GPU (39 s
# interpreted here); the sampler's no-wait check beside it.
KERNEL_TESTS = (
    # The decode attention's split kernel merging its slices itself (`DecodeConfig.fused_reduce`, off by
    # default): bit for bit the reduce launch, the counters left zero (the order between programs is only
    # exercised here).
    KernelTestFile("tests/test_decode_fused_reduce.py"),
    # Never run on a GPU either, and short (two tests on the tiny checkpoint, ~12 s on the CPU): an async
    # step's launch, its sampling with penalties and min_tokens counting the token in flight included,
    # must not wait for the device (torch's sync debug mode), or the step would stop overlapping.
    KernelTestFile("tests/test_async_launch_no_wait.py"),
    # Store, decode and prefill over an FP8 cache.
    KernelTestFile("tests/test_triton_fp8_kv.py"),
    KernelTestFile("tests/test_kernels_attention.py"),
    # The whole model with every Triton kernel, fp32, against transformers: the triton backend only. The
    # torch, cpu and cpu-layers backends run on the CPU device with the C++ CPU kernels (a JIT build of
    # minutes on the GPU machine, nothing GPU-related), as do the file's runner tests.
    KernelTestFile("tests/test_model_parity.py", keyword="triton"),
    # The FP8 linears' one-row launches with SiLU-and-mul made in their loads (`fuse_silu_fp8`, off by
    # default), against SiLU-and-mul's launch then the product, bit for bit ...
    KernelTestFile("tests/test_kernels_fp8_gated_linears.py"),
    # ... and with the RMSNorm made in their loads (`fuse_norm_fp8`, off by default), against the norm's
    # launch then the product.
    KernelTestFile("tests/test_kernels_fp8_normed_linears.py"),
    # RMSNorm and SiLU-and-mul with the FP8 quantization fused in: bit for bit the two launches they replace.
    KernelTestFile("tests/test_kernels_fused_fp8_quant.py"),
    # The float linears on the skinny launch (`skinny_linears`, off by default), against the float64 product.
    KernelTestFile("tests/test_kernels_skinny_mm.py"),
    # The FP8 linears' decode-sized steps: quantization and product in one launch, against the emulated
    # product.
    KernelTestFile("tests/test_kernels_fp8_gemv.py"),
    KernelTestFile("tests/test_kernels_store_kv.py"),
    KernelTestFile("tests/test_prefill_split_kv.py"),
    KernelTestFile("tests/test_kernels_fp8_block_mm.py"),
    KernelTestFile("tests/test_kernels_fp8_skinny_mm.py"),
    KernelTestFile("tests/test_kernels_norm_rope.py"),
    # The block linears' one-row gemv: every check but its tile sweep against the reference, which runs
    # its rule's tile in bf16 there (each tile, dtype and row count is a compile of its own).
    KernelTestFile(
        "tests/test_kernels_fp8_block_gemv.py", keyword="not matches_the_reference or (rule and bf16)"
    ),
    # The FP8 linears' activation quantization: bit for bit quantize_activations; the _scaled_mm layers
    # through it.
    KernelTestFile("tests/test_kernels_fp8_quant.py"),
    KernelTestFile("tests/test_cuda_graph_runner.py"),
    # Every e4m3 code read back in each way the attention kernels convert it (bf16 only checked here:
    # the interpreter truncates to bf16), against torch's.
    KernelTestFile("tests/test_paged_attention_tile_e4m3.py"),
)
# The CPU mode's stand-in (kernels interpreted): one quick file, enough to exercise the step.
CPU_KERNEL_TESTS = (KernelTestFile("tests/test_kernels_store_kv.py"),)


def select_kernel_tests(
    names: str, entries: Sequence[KernelTestFile] = KERNEL_TESTS
) -> tuple[KernelTestFile, ...]:
    """The entries whose file `names` (whitespace-separated, with or without `tests/`) names, in the list's
    order, each with its -k expression; ValueError naming the knob for a file not in the list."""
    by_name = {PurePosixPath(entry.path).name: entry for entry in entries}
    wanted = set()
    for name in names.split():
        base = PurePosixPath(name).name
        if base not in by_name or name not in (base, by_name[base].path):
            raise ValueError(f"{KNOB}: '{name}' is not a kernel test file; they are: {' '.join(by_name)}")
        wanted.add(base)
    if not wanted:
        raise ValueError(f"{KNOB}: names no file; they are: {' '.join(by_name)}")
    return tuple(entry for entry in entries if PurePosixPath(entry.path).name in wanted)


def run_kernel_tests(entries: Sequence[KernelTestFile], repo: Path) -> tuple[bool, str]:
    """One pytest per entry in `repo`, the kernels compiled for the GPU (TRITON_INTERPRET unset): (all
    passed, each file's summary line)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    passed, summaries = True, []
    for entry in entries:
        cmd = [sys.executable, "-m", "pytest", "-q", *entry.pytest_args()]
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, check=False)
        passed = passed and proc.returncode == 0
        summaries.append(f"{entry.path}: {(proc.stdout.strip().splitlines() or ['(no output)'])[-1]}")
    return passed, "; ".join(summaries)
