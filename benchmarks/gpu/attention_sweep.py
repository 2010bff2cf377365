"""Tile-config sweep of the attention kernels for `scripts/gpu_check.py` ("Attention tile configs (sweep)").

The kernels' tile tables (`prefill_config`, `decode_config`) and the decode split count (`PROGRAMS_PER_SM`,
`DEFAULT_PARTITION_SIZE`) are untuned guesses. On the GPU check's shapes (prefill 2k and 8k, decode 4k x 32
and 32k x 8, llama-3.2-1b heads, bf16) this times a fixed list of candidates through the launchers'
own arguments (`config=`, `num_splits=`, `partition_size=`; kernels/*.py are not patched). One more decode
shape is a batch-1 step with a short context as a CUDA graph runs it (GRAPH_DECODE_SHAPE): the split count is
sized for the graph's longest context, and the partition size decides how many of those splits a short
context uses (at 512, a 256-position context is one program per KV head walking it alone):

- every candidate's output is checked against torch SDPA on the same q/k/v (a reference nobody here
  wrote, which checks the default config too; in float32 for decode, on the bf16 inputs): relative max
  abs difference <= SWEEP_MAX_REL_DIFF on an output poisoned with NaN, else the row is WRONG and never
  chosen;
- candidates are timed like the other kernel sections (`time_kernel_s`: 20 calls in one CUDA graph, the
  median of 7 replays, no host time);
- the whole section runs under a wall-clock cap (a Triton attention variant compiles in ~1-3 s on the
  GPU box): a candidate not started before its deadline is "not run (time)", one that fails to compile
  or launch is recorded with its error and the sweep goes on.

The pure parts (candidate lists, split counts, the best valid row, the table) run on CPU in the tests.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sluice.benchmarks.gpu.gpu_benchmarks import (
    DECODE_ATTENTION_SHAPES,
    PREFILL_PROMPT_LENS,
    decode_problem,
    kv_read_bytes,
    prefill_problem,
    run_decode_attention,
    run_prefill_attention,
    sdpa_prefill,
    time_kernel_s,
)
from sluice.kernels.compile_target import device_sm_count
from sluice.kernels.paged_decode_attention import (
    DEFAULT_PARTITION_SIZE,
    PROGRAMS_PER_SM,
    DecodeConfig,
    decode_config,
    pick_num_splits,
)
from sluice.kernels.prefill_attention import PrefillConfig, prefill_config

SWEEP_CAP_S = 75.0  # the whole section's wall clock (SLUICE_GPU_CHECK_SWEEP_S overrides it)
SWEEP_ENV = "SLUICE_GPU_CHECK_SWEEP_S"
PREFILL_SHARE = 0.55  # prefill candidates start only in this first share of the cap; decode gets the rest
SWEEP_MAX_REL_DIFF = 1e-2  # max |ours - SDPA| / max |SDPA|: bf16 outputs, fp32 accumulation either way
NOT_RUN = "not run (time)"

# block_m in {64, 128}, block_n in {32, 64, 128}, 4 or 8 warps, 2-4 stages: the default (128 x 64, 8 warps,
# 3 stages, block-table entries one tile ahead, KV heads interleaved in the launch) first, then the same
# tile with the entries loaded in the tile (the kernel until 2026-11-30: its copies waited for at once),
# then with a head's tiles all launched before the next head's (until 2026-11-30 too), then the default's
# neighbours one knob at a time, then a few 64-row tiles; most likely first, since the cap may cut the tail.
PREFILL_CANDIDATES = (
    PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, prefetch_blocks=False),
    PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, interleave_heads=False),
    PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
    PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=4),
    PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=2),
    PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
    PrefillConfig(block_m=128, block_n=32, num_warps=8, num_stages=3),
    PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
    PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    PrefillConfig(block_m=64, block_n=128, num_warps=4, num_stages=3),
    PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=3),
    PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=3),
    PrefillConfig(block_m=128, block_n=128, num_warps=4, num_stages=2),
    PrefillConfig(block_m=64, block_n=128, num_warps=4, num_stages=2),
)


@dataclass(frozen=True)
class DecodeCandidate:
    """A decode launch: the split kernel's tile, and how many slices a sequence's context is cut into
    (`split_count`: the kernel's `pick_num_splits` at these)."""

    config: DecodeConfig
    programs_per_sm: int = PROGRAMS_PER_SM
    partition_size: int = DEFAULT_PARTITION_SIZE

    def __str__(self) -> str:
        c = self.config
        ahead = ", block entries ahead" if c.prefetch_blocks else ""
        return (
            f"tile_n {c.tile_n}, {c.num_warps} warps, {c.num_stages} stages{ahead}, "
            f"{self.programs_per_sm}/SM, partition {self.partition_size}"
        )

    def code(self) -> str:
        """What goes into the kernel's tables."""
        return (
            f"{self.config!r}, PROGRAMS_PER_SM = {self.programs_per_sm}, "
            f"DEFAULT_PARTITION_SIZE = {self.partition_size}"
        )


def _decode(tile_n: int, warps: int, stages: int, per_sm: int = PROGRAMS_PER_SM) -> DecodeCandidate:
    return DecodeCandidate(DecodeConfig(tile_n, warps, stages), per_sm)


# The tile at the default split count, then the split count at the default tile. partition_size never
# binds at these two shapes (a 4k context has 8 partitions of 512, more than any split count below asks
# for at batch 32), so it stays at its default here; `split_count` shows the slices each row ran. Two rows
# load the block-table entries one tile ahead (`prefetch_blocks`, the prefill's default): a third K/V
# buffer at 3 stages (139 KB of shared memory at head_dim 128: one program an SM), as many as now at 2.
DECODE_CANDIDATES = (
    _decode(128, 4, 3),
    DecodeCandidate(DecodeConfig(128, 4, 3, prefetch_blocks=True)),
    DecodeCandidate(DecodeConfig(128, 4, 2, prefetch_blocks=True)),
    _decode(64, 4, 3),  # the default until run 12
    _decode(64, 4, 2),
    _decode(64, 4, 4),
    _decode(32, 4, 3),
    _decode(128, 8, 3),
    _decode(128, 4, 4),
    _decode(128, 4, 3, per_sm=1),
    _decode(128, 4, 3, per_sm=4),
    _decode(128, 4, 3, per_sm=8),
    _decode(64, 4, 3, per_sm=4),
)


# Batch 1, a 256-position context, in a graph captured for 8k: the partition size sets how many slices the
# short context is cut into (512: one; 128, the default since run 15: two; 64: four), at 128 positions (the
# default tile since run 12), 64 and 32. Run 12 (tiles of 64 by default then) timed 32-position tiles and
# partitions 1.69x the default; run 15 1.39x (default partition 512 then).
GRAPH_DECODE_SHAPE = (256, 1, 8192)  # (context, batch, the graph's max context)
GRAPH_DECODE_CANDIDATES = (
    DecodeCandidate(DecodeConfig(128, 4, 3), partition_size=256),
    DecodeCandidate(DecodeConfig(128, 4, 3), partition_size=512),
    DecodeCandidate(DecodeConfig(64, 4, 3), partition_size=64),
    DecodeCandidate(DecodeConfig(64, 4, 3), partition_size=128),
    DecodeCandidate(DecodeConfig(64, 4, 3), partition_size=256),
    DecodeCandidate(DecodeConfig(32, 4, 2), partition_size=32),
    DecodeCandidate(DecodeConfig(32, 4, 2), partition_size=64),
    DecodeCandidate(DecodeConfig(64, 4, 3), programs_per_sm=4, partition_size=64),
)


def default_decode_candidate(head_dim: int, dtype: torch.dtype) -> DecodeCandidate:
    return DecodeCandidate(decode_config(head_dim, dtype))


def split_count(
    candidate: DecodeCandidate, num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int
) -> int:
    """The kernel's own `pick_num_splits` at the candidate's partition size and programs per SM."""
    return pick_num_splits(
        num_seqs,
        num_kv_heads,
        max_context,
        num_sms,
        partition_size=candidate.partition_size,
        programs_per_sm=candidate.programs_per_sm,
    )


def sweep_cap_s(environ: Mapping[str, str] = os.environ) -> float:
    """The sweep's wall-clock cap: $SLUICE_GPU_CHECK_SWEEP_S (0 skips the sweep), else SWEEP_CAP_S."""
    value = environ.get(SWEEP_ENV, "").strip()
    if not value:
        return SWEEP_CAP_S
    try:
        cap = float(value)
    except ValueError:
        cap = math.nan
    if not cap >= 0:
        raise ValueError(f"{SWEEP_ENV}: seconds >= 0, got '{value}'")
    return cap


def with_default_first(default: Any, candidates: Sequence[Any]) -> list[Any]:
    """The default, then every other candidate once, in order."""
    return [default, *(c for c in candidates if c != default)]


@dataclass
class SweepRow:
    """One candidate at one shape. status: "ok", "WRONG" (output off the reference), "error" (failed to
    compile or launch: `error` says why) or NOT_RUN."""

    candidate: str
    code: str  # the config as the kernel's table spells it
    is_default: bool
    status: str = NOT_RUN
    ms: float | None = None
    rate: float | None = None  # TFLOP/s (prefill) or GB/s (decode)
    vs: float | None = None  # prefill: SDPA's time / ours; decode: share of the copy bandwidth
    max_abs_diff: float | None = None
    rel_diff: float | None = None
    num_splits: int | None = None  # decode only
    error: str = ""

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def differences(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, that over max |want|); NaN anywhere in `got` (an unwritten, poisoned
    element) makes both NaN."""
    diff = float((got.float() - want.float()).abs().max())
    if not torch.isfinite(got).all():
        diff = math.nan
    return diff, diff / max(float(want.float().abs().max()), 1e-6)


def run_candidates(
    candidates: Sequence[Any],
    launch: Callable[[Any, torch.Tensor], object],
    reference: torch.Tensor,
    time_s: Callable[[Callable[[], object]], float],
    rate: Callable[[float], tuple[float, float | None]],
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    code: Callable[[Any], str] = repr,
    out_dtype: torch.dtype | None = None,
) -> list[SweepRow]:
    """Each candidate (the first is the default) checked against `reference`, then timed: `launch(c, out)`
    writes the output into `out` (`reference`'s shape, in `out_dtype` if given, else `reference`'s
    dtype; poisoned with NaN before the checked call), `time_s(fn)` gives seconds
    per call, `rate(s)` (figure, vs) for s seconds. A candidate not started before `deadline` (by `clock`)
    is NOT_RUN; one that raises is an "error" row and the next one runs."""
    out = torch.empty_like(reference, dtype=out_dtype)
    rows = []
    for index, candidate in enumerate(candidates):
        row = SweepRow(str(candidate), code(candidate), is_default=index == 0)
        rows.append(row)
        if clock() >= deadline:
            continue
        try:
            out.fill_(math.nan)
            launch(candidate, out)
            row.max_abs_diff, row.rel_diff = differences(out, reference)
            seconds = time_s(lambda c=candidate: launch(c, out))
        except Exception as error:  # noqa: BLE001 (a config that fails to compile must not end the sweep)
            row.status, row.error = "error", f"{type(error).__name__}: {str(error).strip()[:300]}"
            continue
        row.ms = seconds * 1e3
        row.rate, row.vs = rate(seconds)
        row.status = "ok" if row.rel_diff <= SWEEP_MAX_REL_DIFF else "WRONG"  # NaN: WRONG
    return rows


def best_row(rows: Sequence[SweepRow]) -> SweepRow | None:
    """The fastest row whose output was right; None when no row was."""
    valid = [row for row in rows if row.status == "ok" and row.ms is not None]
    return min(valid, key=lambda row: row.ms) if valid else None


def _order(row: SweepRow) -> tuple[int, float]:
    rank = {"ok": 0, "WRONG": 0, "error": 1}.get(row.status, 2)
    return rank, row.ms if row.ms is not None else math.inf


def _number(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def sweep_table(rows: Sequence[SweepRow], rate_unit: str, vs_name: str) -> str:
    """Rows sorted by time (timed first, then errors, then those not run); the default's and the best's
    rows marked, and each row's time against the default's."""
    best = best_row(rows)
    default_ms = next((row.ms for row in rows if row.is_default), None)
    decode = any(row.num_splits is not None for row in rows)
    headers = ["config", *(["splits"] if decode else []), "ms", rate_unit, vs_name, "vs default",
               "max abs diff", "status"]  # fmt: skip
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    for row in sorted(rows, key=_order):
        marks = [mark for mark, on in (("default", row.is_default), ("**best**", row is best)) if on]
        status = row.status if row.status != "error" else f"error: {row.error.splitlines()[0][:120]}"
        speedup = default_ms / row.ms if default_ms and row.ms else None
        cells = [
            " ".join([row.candidate, *(f"({mark})" for mark in marks)]),
            *([str(row.num_splits or "")] if decode else []),
            _number(row.ms, 4),
            _number(row.rate, 1),
            _number(row.vs, 2),
            "" if speedup is None else f"{speedup:.2f}x",
            "" if row.max_abs_diff is None else f"{row.max_abs_diff:.2g}",
            status,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_line(shape: str, rows: Sequence[SweepRow]) -> str:
    """The line to copy into the kernel's table: `shape`, the best config's code, its time and its speed
    against the default's; or why there is none."""
    best = best_row(rows)
    default = next((row for row in rows if row.is_default), None)
    if best is None:
        return f"{shape}: no candidate gave a right output in time"
    against = ""
    if default is not None and default.ms:
        against = f", {default.ms / best.ms:.2f}x the default's {default.ms:.4f} ms"
    same = " (the default)" if best.is_default else ""
    return f"{shape}: {best.code}{same}: {best.ms:.4f} ms{against}"


# ---- on the GPU ----------------------------------------------------------------------------------


@dataclass
class ShapeSweep:
    """One shape's rows and its results.jsonl record."""

    title: str
    rows: list[SweepRow]
    record: dict[str, Any]
    rate_unit: str
    vs_name: str

    def text(self) -> str:
        return f"**{self.title}**\n\n" + sweep_table(self.rows, self.rate_unit, self.vs_name)


def _shape_record(kernel: str, shape: str, rows: list[SweepRow], **extra: Any) -> dict[str, Any]:
    best = best_row(rows)
    return {
        "kernel": kernel,
        "shape": shape,
        **extra,
        "default": next(row.code for row in rows if row.is_default),
        "best": None if best is None else best.code,
        "best_line": best_line(f"{kernel} {shape}", rows),
        "rows": [row.record() for row in rows],
    }


def sweep_prefill(
    prompt_len: int,
    device: torch.device,
    deadline: float,
    candidates: Sequence[PrefillConfig] = PREFILL_CANDIDATES,
    time_s: Callable[[Callable[[], object]], float] = time_kernel_s,
) -> ShapeSweep:
    """`candidates` (the default config first, added if missing) on bench_prefill_attention's inputs at
    `prompt_len`, against torch SDPA."""
    problem = prefill_problem(prompt_len, device)
    sdpa = sdpa_prefill(problem)
    reference = sdpa()[0].transpose(0, 1).contiguous()
    sdpa_s = time_s(sdpa)
    heads, head_dim = problem.q.shape[1:]
    default = prefill_config(head_dim, problem.q.dtype, heads // problem.k.shape[1], prompt_len)
    rows = run_candidates(
        with_default_first(default, candidates),
        lambda config, out: run_prefill_attention(problem, config=config, out=out),
        reference,
        time_s,
        lambda s: (problem.flops() / s / 1e12, sdpa_s / s),
        deadline,
    )
    shape = f"{prompt_len // 1024}k"
    record = _shape_record("prefill", shape, rows, prompt_len=prompt_len, sdpa_ms=sdpa_s * 1e3)
    title = f"prefill {shape} (torch SDPA {sdpa_s * 1e3:.4f} ms)"
    return ShapeSweep(title, rows, record, "TFLOP/s", "vs SDPA")


def sweep_decode(
    context: int,
    batch: int,
    device: torch.device,
    bandwidth: float | None,
    deadline: float,
    candidates: Sequence[DecodeCandidate] = DECODE_CANDIDATES,
    time_s: Callable[[Callable[[], object]], float] = time_kernel_s,
    graph_context: int | None = None,
) -> ShapeSweep:
    """`candidates` (the default first, added if missing) on bench_attention's inputs at (context, batch),
    against torch SDPA; each row's split count is the one the candidate's PROGRAMS_PER_SM and partition
    size give on this device for `graph_context` (a CUDA graph's longest context), else for `context`."""
    problem = decode_problem(context, batch, device)
    # In float32: a candidate's bf16 output is then off by the kernel's own roundings alone (the output's:
    # <= 0.4% of it on a GPU, 0.8% in the interpreter, which truncates), not by those plus SDPA's.
    kt, vt = (problem.contiguous_kv(cache).float() for cache in (problem.k_cache, problem.v_cache))
    reference = F.scaled_dot_product_attention(problem.q.unsqueeze(2).float(), kt, vt, enable_gqa=True)[
        :, :, 0
    ].contiguous()
    del kt, vt
    num_kv_heads, head_dim = problem.k_cache.shape[2:]
    moved = kv_read_bytes(batch, context, num_kv_heads, head_dim, problem.k_cache.element_size())
    num_sms = device_sm_count(device)
    candidates = with_default_first(default_decode_candidate(head_dim, problem.q.dtype), candidates)
    sized_for = graph_context or context
    splits = {c: split_count(c, batch, num_kv_heads, sized_for, num_sms) for c in candidates}
    rows = run_candidates(
        candidates,
        lambda c, out: run_decode_attention(
            problem, config=c.config, num_splits=splits[c], partition_size=c.partition_size, out=out
        ),
        reference,
        time_s,
        lambda s: (moved / s / 1e9, moved / s / bandwidth if bandwidth else None),
        deadline,
        code=DecodeCandidate.code,
        out_dtype=problem.q.dtype,
    )
    for row, candidate in zip(rows, candidates, strict=True):
        row.num_splits = splits[candidate]
    shape = f"{_positions(context)} x {batch}"
    if graph_context is not None:
        shape += f", graph for {_positions(graph_context)}"
    record = _shape_record(
        "decode", shape, rows, context=context, batch=batch, num_sms=num_sms, graph_context=graph_context
    )
    return ShapeSweep(f"decode {shape} ({num_sms} SMs)", rows, record, "GB/s", "of copy bw")


def _positions(count: int) -> str:
    return f"{count // 1024}k" if count % 1024 == 0 else str(count)


def sweep_attention(device: torch.device, bandwidth: float | None, cap_s: float) -> Iterator[ShapeSweep]:
    """Prefill at 2k and 8k, then decode at 4k x 32, 32k x 8 and GRAPH_DECODE_SHAPE, one shape at a time
    (yielded as each ends, so the caller records it): prefill candidates start within the first
    PREFILL_SHARE of `cap_s`, decode ones within the whole."""
    start = time.monotonic()
    for prompt_len in PREFILL_PROMPT_LENS:
        yield sweep_prefill(prompt_len, device, start + PREFILL_SHARE * cap_s)
        torch.cuda.empty_cache()
    for context, batch in DECODE_ATTENTION_SHAPES:
        yield sweep_decode(context, batch, device, bandwidth, start + cap_s)
        torch.cuda.empty_cache()
    context, batch, graph_context = GRAPH_DECODE_SHAPE
    yield sweep_decode(
        context, batch, device, bandwidth, start + cap_s, GRAPH_DECODE_CANDIDATES, graph_context=graph_context
    )


def sweep_section(cap_s: float, shapes: Sequence[ShapeSweep]) -> tuple[str, list[str]]:
    """The section's markdown (each shape's table, then the best config per shape) and the shapes whose
    default config gave a WRONG output."""
    text = "\n\n".join([
        f"Wall-clock cap {cap_s:.0f} s; outputs checked against torch SDPA; timed as the sections above.",
        *(shape.text() for shape in shapes),
        "Best config per shape:\n\n" + "\n".join(f"- {shape.record['best_line']}" for shape in shapes),
    ])  # fmt: skip
    wrong = [shape.title for shape in shapes if any(r.is_default and r.status == "WRONG" for r in shape.rows)]
    return text, wrong
