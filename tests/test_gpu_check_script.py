"""scripts/gpu_check.py imports without a GPU, and its pure helpers compute what the report prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import paged_batch  # noqa: F401  (first: runs the kernels in the interpreter without CUDA)
import pytest
import torch

from sluice.benchmarks.gpu import gpu_benchmarks

_SPEC = importlib.util.spec_from_file_location(
    "gpu_check", Path(__file__).parent.parent / "scripts" / "gpu_check.py"
)
gpu_check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_check)


def test_markdown_table():
    table = gpu_check.markdown_table(["batch", "ms"], [[1, 12.3456], [128, 0.5]])
    assert table == "| batch | ms |\n| --- | --- |\n| 1 | 12.3 |\n| 128 | 0.5 |"


def test_markdown_table_rejects_a_short_row():
    with pytest.raises(ValueError, match="^rows: a row has 1 cells, expected 2$"):
        gpu_check.markdown_table(["a", "b"], [[1]])


def test_floor_and_bytes():
    # 2.47 GB of bf16 weights at 3 TB/s: 0.823 ms per batch-1 step at best.
    assert gpu_benchmarks.floor_step_time_s(2_470_000_000, 3e12) == pytest.approx(8.2333e-4, rel=1e-4)
    with pytest.raises(ValueError, match="^bandwidth_bytes_per_s: must be > 0"):
        gpu_benchmarks.floor_step_time_s(1, 0.0)
    # 32 sequences x 4096 positions x 8 kv heads x 64 dims x 2 bytes, for K and for V.
    assert gpu_benchmarks.kv_read_bytes(32, 4096, 8, 64, 2) == 268_435_456


def test_decode_step_inputs_are_disjoint_pure_decode_rows():
    inputs = gpu_benchmarks.decode_step_inputs(3, 40, 16, torch.device("cpu"))
    md = inputs.metadata
    assert md.is_pure_decode and md.seq_lens.tolist() == [40, 40, 40]
    assert md.block_tables.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert md.slot_mapping.tolist() == [2 * 16 + 7, 5 * 16 + 7, 8 * 16 + 7]
    assert inputs.positions.tolist() == [39, 39, 39]


def test_goal_rows_state_each_goal_and_whether_it_was_met():
    rows = gpu_benchmarks.goal_rows(
        batch1_step_s=1.2e-3, floor_s=1e-3, batch1_speedup=1.4, long_context_fraction=0.75
    )
    assert [row[2] for row in rows] == ["met", "NOT met", "met"]
    assert rows[0][1] == pytest.approx(1.2) and rows[1][1] == 1.4 and rows[2][1] == 0.75


def test_parity_check_runs_the_triton_model_against_transformers():
    # The GPU check's own parity path, on CPU in float32 with the kernels interpreted: it must pass
    # with float32-sized differences, so a regression in the script or the fused model path fails here.
    ok, rows = gpu_check.check_parity(torch.device("cpu"), torch.float32, steps=4)
    assert ok
    assert rows[0][0] == "prefill last-token logits, max abs diff" and rows[0][1] < 1e-4
    assert rows[1] == ["greedy tokens equal", "4/4"]


def test_prefill_inputs_and_causal_flops():
    md = gpu_benchmarks.prefill_step_inputs(40, 16, torch.device("cpu")).metadata
    assert md.query_start_loc.tolist() == [0, 40] and md.seq_lens.tolist() == [40]
    assert md.block_tables.tolist() == [[0, 1, 2]] and md.slot_mapping.tolist() == list(range(40))
    # 1 head, dim 1, 2 tokens: QK^T and PV each cover 3 visible pairs -> 2 * 2 * 3 flops.
    assert gpu_benchmarks.causal_attention_flops(2, 1, 1) == 12


def test_report_keeps_every_section_and_records_failures(tmp_path):
    out = tmp_path / "perf" / "gpu_check.md"
    report = gpu_check.Report(out, "# GPU check: test")
    report.section("first", lambda: "| a |")
    assert out.read_text() == "# GPU check: test\n\n## first\n\n| a |\n" and report.ok

    def failing_check() -> str:
        raise gpu_check.CheckFailed("2/8 tokens")

    def broken() -> str:
        raise RuntimeError("CUDA error: out of memory")

    report.section("parity", failing_check)
    report.section("bench", broken)
    report.section("after", lambda: "still measured")
    text = out.read_text()
    assert not report.ok
    assert "## parity\n\n**FAIL**\n\n2/8 tokens" in text
    assert "## bench\n\n**ERROR**" in text and "RuntimeError: CUDA error: out of memory" in text
    assert text.endswith("## after\n\nstill measured\n")


def test_sections_are_in_report_order():
    check = gpu_check.GpuCheck(torch.device("cpu"), skip_tests=True, skip_e2e=True)
    titles = [title for title, _ in check.sections()]
    assert titles[0] == "Kernel tests (compiled for the GPU)" and titles[-2:] == [
        "Goals",
        "End to end: Sluice vs transformers.generate (llama-3.2-1b shape, bf16)",
    ]
    assert check.tests() == "skipped" and check.end_to_end() == "skipped"
