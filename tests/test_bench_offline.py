"""`python -m sluice.benchmarks.engine.offline`: both sides run the same checkpoint and workload; JSON holds
every run, with the prompt tokens Sluice served from its prefix cache (none: the warm-up's prompt is its
own). `CacheHits`, the offline benchmarks' check that a run measured the engine and not the cache, on a
real engine."""

from __future__ import annotations

import json

from sluice.benchmarks.engine import offline as bench
from sluice.benchmarks.engine.cache_hits import CacheHits, common_prefix_len
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams


def test_throughput_bench_compares_sluice_with_transformers_on_the_same_workload(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--num-requests", "3", "--output-len", "4", "--json", str(out)])
    results = json.loads(out.read_text())
    assert [r["name"] for r in results] == [
        "sluice",
        "transformers sequential",
        "transformers static batch 8",
    ]
    assert [r["output_tokens"] for r in results] == [12, 12, 12]
    assert all(r["tokens_per_second"] > 0 for r in results)
    assert results[0]["ttft_mean"] is not None and results[1]["ttft_mean"] is None
    prompt_tokens = sum(len(p) for p in bench.mixed_workload(3, 32000, seed=0))  # the tiny preset's vocab
    assert (results[0]["cached_tokens"], results[0]["prompt_tokens_computed"]) == (0, prompt_tokens)
    assert results[0]["cache_hits_unexpected"] is False and results[1]["cached_tokens"] is None
    printed = capsys.readouterr().out
    assert "Throughput (output tokens/s; ratio vs transformers sequential)" in printed
    assert "transformers sequential" in printed and "1.00x" in printed


def test_workloads_are_seeded_and_shaped():
    mixed = bench.mixed_workload(5, 100, seed=3)
    assert mixed == bench.mixed_workload(5, 100, seed=3) != bench.mixed_workload(5, 100, seed=4)
    assert all(32 <= len(p) <= 512 and all(3 <= t < 100 for t in p) for p in mixed)
    agent = bench.agent_workload(4, 100, seed=0, system_len=20)
    assert all(p[:20] == agent[0][:20] and 52 <= len(p) <= 148 for p in agent)


def test_common_prefix_of_prompts():
    assert common_prefix_len([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix_len([[1, 2], [1, 2, 3]]) == 2
    assert common_prefix_len([[7, 2], [1, 2]]) == 0
    assert common_prefix_len([[1, 2, 3]]) == 0  # one prompt shares nothing with another


def test_cache_hits_flag_a_run_that_repeats_prompts_the_engine_has_seen(llama_dir):
    llm = LLM(llama_dir, num_blocks=32, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    system = list(range(3, 19))  # one block every prompt shares, as a system prompt
    prompts = [system + [100 + 10 * i + k for k in range(24)] for i in range(3)]  # 40 tokens each
    first = CacheHits.of(llm.generate(prompts, params))
    assert first.shared_prefix_len == 16 and not first.unexpected
    assert first.cached_tokens <= 2 * 16 and first.computed_tokens == 3 * 40 - first.cached_tokens
    again = CacheHits.of(llm.generate(prompts, params))  # each prompt's two full blocks are cached
    assert (again.cached_tokens, again.computed_tokens, again.num_unexpected) == (3 * 32, 3 * 8, 3)
    assert again.warning("again").startswith("warning: again: 3 requests hit the prefix cache (96 prompt")
    assert not CacheHits.of(llm.generate(prompts, params), shared_prefix_len=32).unexpected
