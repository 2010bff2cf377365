"""`sluice.benchmarks.gpu.fused_quant_bench` in its CPU mode (the interpreter, a tiny shape): it runs end to
end, both ways write the same bits, and it writes both tables. Its GPU figures come from the GPU check's
kernel_bench step."""

from __future__ import annotations

import re

from sluice.benchmarks.gpu.fused_quant_bench import main


def test_the_cpu_mode_writes_both_tables(tmp_path):
    out = tmp_path / "fused_quant.md"
    assert main([str(out), "--device", "cpu"]) == 0
    report = out.read_text()
    assert report.startswith("# FP8 activation quantization fused into RMSNorm / SiLU-and-mul (cpu,")
    rows = re.findall(
        r"^\| tiny \| (norm|silu) \| (token|group 32) \| (\d+) \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ "
        r"\| ([^|]*) \| (\w+) \|$",
        report,
        re.M,
    )
    # per token the fused launch also the other way: the norm on 32 warps, the SiLU-and-mul in 64-column
    # tiles (the tiny shape's 160 in three)
    other = {"norm": "32 warps", "silu": "tile 64"}
    assert [(op, scales, m, re.sub(r"^[0-9.]+ ", "", cell), same) for op, scales, m, cell, same in rows] == [
        (op, scales, m, f"({other[op]})" if scales == "token" else "", "True")
        for scales in ("token", "group 32")
        for op in ("norm", "silu")
        for m in "14"
    ]
    per_layer = report.split("## Per decoder layer")[1]
    layers = re.findall(r"^\| tiny \| (token|group 32) \| (\d+) \|", per_layer, re.M)
    assert layers == [("token", "1"), ("token", "4"), ("group 32", "1"), ("group 32", "4")]
