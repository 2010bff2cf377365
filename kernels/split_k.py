"""Split-K for the skinny linears (`fp8_skinny_mm`'s launches and `skinny_mm`; `fp8_gemv`, with its own
tiles, shares the reduce): a product whose few output channels would leave SMs idle splits its K columns
over programs, each adding up one slice:

    grid (cdiv(N, BLOCK_N), SPLIT_K)    a program: BLOCK_N output channels over columns [k_start, k_end)
    workspace [SPLIT_K, M, N] float32   each split's partial sums (`split_k_output`; one split writes y)
    y [M, N] = (sum over splits, in split order) * x_scale[m] * w_scale[n]      (unscaled for float weights)

The partial sums are added in a fixed order by a second launch (`reduce_split_k`), so y is deterministic,
unlike atomic adds. `split_k_rule` picks the fewest splits (powers of two, each at least BLOCK_K wide) that
give every SM MIN_PROGRAMS_PER_SM programs.

`SkinnyConfig.fused_reduce` adds the partial sums in the same launch instead (`add_splits_if_last`): each
program stores its partial sums, then counts itself in on its channel block's counter (an int32, atomic,
acq_rel); the last of the SPLIT_K to arrive reads the others' partial sums back (after its acquire, past L1)
and adds them in split order, as the reduce launch does, so y is bit for bit the same. It then puts the
counter back to 0, so the counters (`split_counters`, one zeroed buffer per device, allocated before any CUDA
graph captures a launch and never freed) are zero before every launch and every graph replay. Launches on
two streams at once would share them: the engine runs one stream. Why: the reduce launches were 2.6% of an 8b
FP8 one-row step's device time and 4% of a 64-row step's on an H200 (run 14: 64 and 96 launches of 1.4-2.1
us), each also a gap in the graph. Off by default until a GPU run times it and runs its tests: the
interpreter runs programs one at a time and cannot check the memory ordering.

The reduce kernel keeps its first name, `_fp8_skinny_reduce_kernel`, under which the GPU runs' profiles
(docs/perf/) list it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sluice.kernels.dependent_launch import pdl_launch_options, wait_prior_kernel
from sluice.kernels.tensor_checks import check_power_of_two

MIN_PROGRAMS_PER_SM = 1.5
REDUCE_BLOCK = 1024  # channels a program of the reduce launch adds up


@dataclass(frozen=True)
class SkinnyConfig:
    """A skinny launch's tile and split: BLOCK_N output channels a program, BLOCK_K columns a step, at
    most split_k programs over K per channel block."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fused_reduce: bool = False  # the splits added by each channel block's last split (above)

    def __post_init__(self) -> None:
        check_power_of_two("block_n", self.block_n, 16)
        check_power_of_two("block_k", self.block_k, 16)  # 16: block scales of 16 columns (fp16 dot)
        check_power_of_two("split_k", self.split_k, 1)


def split_k_rule(config: SkinnyConfig, out_features: int, in_features: int, sm_count: int) -> SkinnyConfig:
    """`config` with the fewest K splits (powers of two, each at least BLOCK_K wide) that give every SM
    MIN_PROGRAMS_PER_SM programs of BLOCK_N output channels."""
    programs = triton.cdiv(out_features, config.block_n)
    split_k = 1
    while (
        programs * split_k < MIN_PROGRAMS_PER_SM * sm_count and in_features // (2 * split_k) >= config.block_k
    ):
        split_k *= 2
    return replace(config, split_k=split_k)


@triton.jit
def split_program(K, k_per_split, BLOCK_N: tl.constexpr):
    """A program of a (cdiv(N, BLOCK_N), SPLIT_K) grid: its BLOCK_N output channels, its split and the
    split's columns [k_start, k_end)."""
    channels = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    k_start = split * k_per_split
    return channels, split, k_start, tl.minimum(k_start + k_per_split, K)


@triton.jit
def workspace_offsets(split, rows, channels, M, N):
    """Where split `split`'s partial sums of (rows, channels) sit in the workspace [SPLIT_K, M, N]."""
    return (split * M + rows).to(tl.int64) * N + channels


@triton.jit
def _sum_splits(workspace_ptr, rows, channels, mask, M, N, SPLIT_K: tl.constexpr, PAST_L1: tl.constexpr):
    """The SPLIT_K partial sums of (rows, channels) added in split order, in fp32: the one order of both
    reduce paths (the reduce launch, `add_splits_if_last`), so that they agree bit for bit."""
    total = tl.zeros(mask.shape, dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        partial = workspace_ptr + workspace_offsets(split, rows, channels, M, N)
        if PAST_L1:  # written by other programs of this launch: read from L2, never a stale L1 line
            total += tl.load(partial, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            total += tl.load(partial, mask=mask, other=0.0)
    return total


@triton.jit
def add_splits_if_last(
    y_ptr,
    workspace_ptr,
    counter_ptr,
    x_scale_ptr,
    w_scale_ptr,
    rows,
    channels,
    out_mask,
    M,
    N,
    x_scale_stride,
    SPLIT_K: tl.constexpr,
    SCALED: tl.constexpr,
):
    """FUSED_REDUCE: counts this split in on its channel block's counter; the last of the SPLIT_K adds
    every split's partial sums (`_sum_splits`, as the reduce launch), scales them unless they are scaled
    already, stores y and puts the counter back to 0 for the next launch."""
    tl.debug_barrier()  # every thread's partial sums are stored before the count releases them
    counter = counter_ptr + tl.program_id(0)
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
        total = _sum_splits(workspace_ptr, rows[None, :], channels[:, None], out_mask, M, N, SPLIT_K, True)
        if SCALED:
            x_scale = tl.load(x_scale_ptr + rows * x_scale_stride, mask=rows < M, other=0.0)
            w_scale = tl.load(w_scale_ptr + channels, mask=channels < N, other=0.0)
            total = total * x_scale[None, :] * w_scale[:, None]
        y = y_ptr + rows[None, :] * N + channels[:, None]
        tl.store(y, total.to(y_ptr.dtype.element_ty), mask=out_mask)
        tl.store(counter, 0)


@triton.jit
def _fp8_skinny_reduce_kernel(
    y_ptr,  # [M, N] out dtype
    workspace_ptr,  # [SPLIT_K, M, N] float32
    x_scale_ptr,
    w_scale_ptr,
    M,
    N,
    x_scale_stride,
    BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SCALED: tl.constexpr = True,  # False: the partial sums are scaled already (block scales)
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    wait_prior_kernel(PDL)
    mask = channels < N
    total = _sum_splits(workspace_ptr, row, channels, mask, M, N, SPLIT_K, False)
    if SCALED:
        x_scale = tl.load(x_scale_ptr + row * x_scale_stride)
        w_scale = tl.load(w_scale_ptr + channels, mask=mask, other=0.0)
        total = total * x_scale * w_scale
    tl.store(y_ptr + row * N + channels, total.to(y_ptr.dtype.element_ty), mask=mask)


def split_k_output(y: torch.Tensor, in_features: int, config: SkinnyConfig) -> tuple[int, int, torch.Tensor]:
    """(columns a split, splits, where the launch writes) for y [M, N] over `in_features` columns: splits
    of whole BLOCK_K tiles, at most config.split_k and each with columns; y itself for one split, else a
    float32 workspace [splits, M, N] for `reduce_split_k`."""
    k_per_split = triton.cdiv(triton.cdiv(in_features, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(in_features, k_per_split)
    if split_k == 1:
        return k_per_split, split_k, y
    return k_per_split, split_k, torch.empty((split_k, *y.shape), dtype=torch.float32, device=y.device)


SPLIT_COUNTERS = 1 << 16  # channel blocks a fused-reduce launch may have (llama-3-8b's most: 448)
_split_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, channel_blocks: int) -> torch.Tensor | None:
    """The FUSED_REDUCE launches' counters on `device`: SPLIT_COUNTERS int32 zeros, allocated at the first
    call and kept (a captured CUDA graph holds their address); the launches leave them zero. None where a
    launch has more channel blocks (the decode attention's: (sequence, KV head) pairs,
    `sluice.kernels.paged_decode_attention`), or while a CUDA graph is being captured before any launch
    allocated them: that launch adds its splits in the reduce launch instead."""
    if channel_blocks > SPLIT_COUNTERS:
        return None
    counters = _split_counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _split_counters[device] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return counters


def reduce_split_k(
    y: torch.Tensor, workspace: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None
) -> None:
    """y [M, N] (contiguous) = the split-K partial sums workspace [split_k, M, N] float32 added in split
    order, times `scales` = (x_scale: M or 1 values, contiguous, float32; weight_scale [N] float32): the
    emulated path's order; None: the partial sums are scaled already (block scales) or unscaled (float
    weights). Shared by the kernels that split K (`fp8_skinny_mm`'s, `fp8_gemv`, `skinny_mm`)."""
    split_k, num_rows, out_features = workspace.shape
    x_scale, weight_scale = scales if scales is not None else (workspace, workspace)  # unread when unscaled
    grid = (num_rows, triton.cdiv(out_features, REDUCE_BLOCK))
    _fp8_skinny_reduce_kernel[grid](
        y,
        workspace,
        x_scale,
        weight_scale,
        num_rows,
        out_features,
        scale_row_stride(x_scale) if scales is not None else 0,
        BLOCK=REDUCE_BLOCK,
        SPLIT_K=split_k,
        SCALED=scales is not None,
        **pdl_launch_options(y.device),
    )


def scale_row_stride(x_scale: torch.Tensor) -> int:
    """1 for a scale per row, 0 for one scale (per tensor) that every row reads."""
    return 1 if x_scale.numel() > 1 else 0
