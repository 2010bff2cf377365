"""Programmatic dependent launch (PDL, compute capability 9.0+): a kernel starts before the one ahead of it
in the stream has finished, and waits inside for its results.

A decode step is hundreds of short launches one after another (llama-3-8b's FP8 one-row step: ~350 of
2-60 us each), and a CUDA graph still leaves a gap of about a microsecond between two of them (run 15's
1b step: ~0.9 us between each of 171 launches). Launched with PDL (Triton's `launch_pdl`, the launch
attribute `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, kept as programmatic edges when a CUDA
graph captures it), a kernel's programs may be placed on the SMs as soon as every program of the kernel
before it has signalled (or exited), and run their prologue there:

    kernel A:  [wait] [signal] ..... body ............ |
    kernel B:                 [launch, prologue] [wait ------> ] body ...... |

Each of Sluice's Triton kernels calls `wait_prior_kernel(PDL)` before it reads or writes any tensor that
another kernel may write (activations, the KV cache, block tables, positions, scales computed on the GPU),
so its results are those of a plain launch, bit for bit: only what never changes during a step (weights,
norm weights) may be loaded above it. `griddepcontrol.wait` waits for every prerequisite grid to complete
and its writes to be visible, so kernels without PDL (cuBLAS, torch's) before or after one are ordered as
always. The signal (`griddepcontrol.launch_dependents`) comes right after the wait, so at most the next
kernel is placed early, never a chain of them.

The FP8 linears of a decode step (`fp8_skinny_mm`, `fp8_gemv`; and the float ones where `skinny_linears`
puts them on `skinny_mm`) do one more thing before their wait: they ask L2 for the first bytes of their
weight rows (`prefetch_weight_rows`, `prefetch.global.L2`: a hint, no register, no fault), so that a
linear streams part of its weights while the norm, SiLU-and-mul or
attention before it still runs (at one row those are one or a few programs on one SM, 2-13 us each on
the 8b FP8 step of run 15, while the other SMs idle). `weight_prefetch_bytes` sizes it so that a launch
asks for at most L2_PREFETCH_BUDGET in all, well inside an H100/H200's 50 MB L2, where it stays until the
loads that follow take it.

`dependent_launch(device)`: on for a CUDA device of compute capability 9.0+ (and for the ahead-of-time
sm_90 compiles of scripts/compile_kernels.py, as `store_kv.gpu_e4m3`), off under TRITON_INTERPRET=1 (whose
programs run one after another) and with SLUICE_PDL=0, read at each launch so that a benchmark can compare
both in one process. Not timed on a GPU yet (2026-12-01): the GPU check's `pdl` section compares the
batch-1 graph step with and without it and requires the same logits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sluice.kernels.compile_target import compiles_for_capability

PDL_ENV = "SLUICE_PDL"  # "0": every launch without PDL
L2_PREFETCH_BUDGET = 16 * 2**20  # bytes of weights the programs of one launch ask L2 for before their wait
MAX_PREFETCH_ROW_BYTES = 4096
CACHE_LINE = 128


def dependent_launch(device: torch.device) -> bool:
    """Whether launches on `device` use PDL: the launchers' `PDL` constexpr and Triton's `launch_pdl`."""
    return os.environ.get(PDL_ENV) != "0" and compiles_for_capability(device, (9, 0))


def pdl_launch_options(device: torch.device) -> dict[str, bool]:
    """A launch's keyword arguments for PDL: the kernel's `PDL` constexpr and Triton's `launch_pdl` option
    (the interpreter drops the latter)."""
    enabled = dependent_launch(device)
    return {"PDL": enabled, "launch_pdl": enabled}


def weight_prefetch_bytes(
    device: torch.device, num_programs: int, rows_per_program: int, row_bytes: int
) -> int:
    """The launch's PREFETCH_BYTES: how much of each of a program's `rows_per_program` weight rows (of
    `row_bytes` in its slice) to ask L2 for before the wait, a power of two from one cache line to
    MAX_PREFETCH_ROW_BYTES, the launch's programs together asking for at most L2_PREFETCH_BUDGET; 0 (none)
    without PDL or where a line a row does not fit."""
    if not dependent_launch(device):
        return 0
    budget = L2_PREFETCH_BUDGET // max(1, num_programs * rows_per_program)
    per_row = min(row_bytes, MAX_PREFETCH_ROW_BYTES, budget)
    return 1 << (per_row.bit_length() - 1) if per_row >= CACHE_LINE else 0


@triton.jit
def prefetch_weight_rows(
    w_ptr, channels, N, stride_w, k_lo, k_hi, PREFETCH_BYTES: tl.constexpr, ELEMENT_BYTES: tl.constexpr = 1
):
    """Asks L2 for PREFETCH_BYTES of the weight rows `channels` ([rows] indices into w_ptr's N rows of
    stride_w elements of ELEMENT_BYTES, each valid over columns [0, k_hi)) from column k_lo on, one
    `prefetch.global.L2` per 128-byte line, rows clamped to N - 1 and columns to k_hi - 1: a hint that
    loads no register and cannot fault. PREFETCH_BYTES 0 (`weight_prefetch_bytes` without PDL, the
    interpreter's case): nothing."""
    if PREFETCH_BYTES > 0:
        rows = w_ptr + tl.minimum(channels, N - 1)[:, None].to(tl.int64) * stride_w
        cols = tl.minimum(k_lo + tl.arange(0, PREFETCH_BYTES // 128) * (128 // ELEMENT_BYTES), k_hi - 1)
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];",
            "=r,l",
            [rows + cols[None, :]],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def wait_prior_kernel(PDL: tl.constexpr):
    """PDL: blocks until the kernels before this one in the stream have completed and their writes are
    visible, then lets the next kernel's programs be placed. Nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
