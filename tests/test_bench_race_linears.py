"""`python -m sluice.benchmarks.engine.race_linears`: the race's workload shaped like the engine's schedule,
its FLOPs equal to the race's floor's count on the real model, both libraries computing x @ W^T, and a whole
run in child processes reporting each library."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.benchmarks.engine import machine_limits as limits
from sluice.benchmarks.engine import race_linears as bench
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.default_model import default_model_path
from sluice.engine.loading.gguf_loader import load_gguf


def test_schedule_chunks_the_prompts_then_decodes_every_request():
    # 3 requests x 5 prompt tokens in chunks of 6: rows 0-5, 6-11, 12-14; prompts end at rows 4, 9, 14
    assert bench.schedule(3, 5, 4, 6) == [(6, 1), (6, 1), (3, 1), (3, 3), (3, 3), (3, 3)]
    assert bench.schedule(64, 64, 64, 2048) == [(2048, 32), (2048, 32)] + [(64, 64)] * 63


def test_workload_flops_are_the_race_floors_on_the_embedded_model():
    arch = load_gguf(default_model_path()).arch
    model = LLM(dtype="float32").engine.model_runner.model  # the loaded, packed model's parameters
    per_request = limits.linear_flops_per_request(model, prompt_len=64, max_tokens=64)
    assert bench.step_flops(arch, bench.schedule(64, 64, 64, 2048)) == 64 * per_request


@pytest.mark.parametrize("library", bench.LIBRARIES)
def test_both_libraries_compute_x_times_w_transposed(library):
    weight, x = torch.randn(40, 24), torch.randn(5, 24)
    out = torch.as_tensor(bench.make_matmul(library, weight)(x))
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_run_times_every_step_of_both_libraries_in_their_own_processes(capsys):
    bench.main(["--concurrency", "2", "--prompt-len", "3", "--max-tokens", "2", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert "2 requests x (3 prompt + 2 output) tokens, linears only: 2 steps (1 prefill" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["sluice", "numpy"]
    for line in lines[1:]:
        assert "prefill " in line and "; decode " in line and "tok/s (best round)" in line


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--token-budget", "0"])
    assert "--token-budget: must be >= 1, got 0" in capsys.readouterr().err
