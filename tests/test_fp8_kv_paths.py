"""`sluice.benchmarks.gpu.fp8_kv_paths`, the kernel-level GPU comparison of the FP8-KV paths, in its CPU
mode: the same code on tiny shapes under Triton's interpreter (its times mean nothing; its checks do),
and its shapes are the GPU check's and llama-3-8b's serving shape."""

from __future__ import annotations

import dataclasses

import torch

from sluice.benchmarks.gpu import fp8_kv_paths
from sluice.benchmarks.gpu.gpu_benchmarks import DECODE_ATTENTION_SHAPES, PREFILL_PROMPT_LENS
from sluice.engine.loading.presets import preset_arch

CPU = torch.device("cpu")


def _heads(shape: fp8_kv_paths.AttentionShape) -> tuple[int, int, int]:
    return shape.num_heads, shape.num_kv_heads, shape.head_dim


def test_the_cpu_mode_writes_a_passing_table_of_every_tiny_shape(tmp_path, capsys):
    out = tmp_path / "fp8_kv_paths.md"
    assert fp8_kv_paths.main(out, device="cpu", tiny=True) == 0
    text = out.read_text()
    assert text in capsys.readouterr().out and "CPU, Triton's interpreter" in text
    lines = text.splitlines()
    assert "| " + " | ".join(fp8_kv_paths.HEADERS) + " |" in lines
    rows = [line.split(" | ") for line in lines if line.startswith(("| decode |", "| prefill |"))]
    assert [row[1] for row in rows] == [shape.label for shape in fp8_kv_paths.TINY_SHAPES]
    for row in rows:
        assert row[-2:] == ["yes", "PASS |"] and float(row[8]) <= fp8_kv_paths.INTERPRETED_MAX_REL_DIFF
        assert all(float(cell.rstrip("x")) > 0 for cell in row[2:8])


def test_a_wrong_path_fails_its_row():
    """A fold path that doubles its output misses the reference and differs from dequantize at unit scales."""
    shape = fp8_kv_paths.TINY_SHAPES[0]
    case = fp8_kv_paths.make_case(shape, CPU)

    def wrong(k_cache, v_cache, kv_scales=None, fold=None, out=None):
        result = case.run(k_cache, v_cache, kv_scales, fold, out)
        return result.mul_(2) if fold else result

    row = fp8_kv_paths.measure(shape, dataclasses.replace(case, run=wrong), fp8_kv_paths.wall_time_s)
    assert row[-2:] == ["NO", "FAIL"] and float(row[8]) > 0.1
    assert not fp8_kv_paths.passed([row])


def test_the_gpu_shapes_are_the_gpu_checks_and_llama_3_8b_serving():
    decode = [s for s in fp8_kv_paths.SHAPES if s.kernel == "decode"]
    prefill = [s for s in fp8_kv_paths.SHAPES if s.kernel == "prefill"]
    one_b, eight_b = preset_arch("llama-3.2-1b"), preset_arch("llama-3-8b")
    one_b_heads = (one_b.num_attention_heads, one_b.num_key_value_heads, one_b.head_dim)
    eight_b_heads = (eight_b.num_attention_heads, eight_b.num_key_value_heads, eight_b.head_dim)
    assert [(s.context, s.batch) for s in decode[:2]] == list(DECODE_ATTENTION_SHAPES)
    assert [_heads(s) for s in decode[:2]] == [one_b_heads] * 2
    assert (decode[2].batch, decode[2].context, _heads(decode[2])) == (64, 256, eight_b_heads)
    assert [(s.batch, s.context, _heads(s)) for s in prefill] == [(1, PREFILL_PROMPT_LENS[0], one_b_heads)]
