"""`python -m sluice.bench.cpu_race`: each engine's runner counts the tokens it produced; the table's
ratios are Sluice's rate over each other engine's; a missing llama-cpp-python is reported, not fatal."""

from __future__ import annotations

import sys
import time

import torch
from sluice.bench import cpu_race as race

from engine.frontend.llm import LLM


def test_runners_decode_every_requested_token(llama_dir):
    from transformers import AutoModelForCausalLM

    prompts = race.make_prompts(3, 8, vocab_size=512, seed=0)
    assert prompts == race.make_prompts(3, 8, vocab_size=512, seed=0)
    assert len(prompts) == 3 and all(len(p) == 8 and all(3 <= t < 512 for t in p) for p in prompts)
    llm = LLM(llama_dir, dtype="float32", num_blocks=16)
    start = time.perf_counter()
    rate, decode_rate = race.run_sluice(llm, prompts, 5)
    seconds = time.perf_counter() - start
    assert 3 * 5 <= rate * seconds < 3 * 5 * 1.1  # 3 requests x 5 tokens over (about) the run's wall time
    # 3 x 4 tokens after the first ones, over less time than the whole run (the prefill is not in it)
    assert decode_rate is not None and decode_rate > 3 * 4 / seconds
    hf_rate = race.run_transformers(AutoModelForCausalLM.from_pretrained(llama_dir).eval(), prompts, 5)
    assert 0 < 1 / hf_rate < 60


def test_table_prints_ratios_against_sluice(capsys):
    rows = [
        race.Row("sluice fp32", 1, 30.0),
        race.Row("transformers static batch", 1, 15.0),
        race.Row("sluice fp32", 16, 200.0),
        race.Row("transformers static batch", 16, 80.0),
        race.Row("llama.cpp (Q4_1 GGUF)", 1, None, "llama.cpp run failed"),
    ]
    race.print_table(rows, [1, 16])
    printed = capsys.readouterr().out
    ratio_line = next(line for line in printed.splitlines() if "/ transformers" in line)
    assert ratio_line.split()[-2:] == ["2.00x", "2.50x"]
    assert "note: llama.cpp (Q4_1 GGUF) at 1: llama.cpp run failed" in printed


def test_missing_llama_cpp_python_is_a_reason_not_an_error():
    assert "no --llamacpp-python given" in race.llamacpp_unavailable_reason(None)
    reason = race.llamacpp_unavailable_reason(sys.executable)  # the project's venv has no llama_cpp
    assert reason is not None and "cannot import llama_cpp" in reason


def test_machine_limits_are_measured():
    assert race.read_bandwidth_gbs(megabytes=16, repeats=1) > 0.1
    assert race.gemm_gflops(size=256, repeats=2) > 0.1
    assert torch.get_num_threads() >= 1
