"""Prefix-cache metrics as vLLM counts them: the hit rate counts only a request's first lookup (a request
resumed after preemption finds its own blocks and is counted apart, vLLM's `PrefixCacheStats.preempted_*`;
one wanting prompt logprobs reads no cache and is not counted), and a request with n samples reports its
prompt once, with sample 0's cached tokens, whatever order its samples finish in."""

from __future__ import annotations

import random

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from service_harness import ServerThread, long_engine_config

from sluice import Client, generate_request
from sluice.engine.frontend.llm import LLM
from sluice.engine.outputs import EngineStats, RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.service.generation import RequestProgress
from sluice.service.metrics import ServerMetrics
from sluice.service.server import ServerConfig

BLOCK = 16


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 512) for _ in range(n)]


def test_a_request_resumed_after_preemption_counts_its_lookup_apart(llama_dir):
    """`low` fills the 4-block cache; `high` preempts it and takes its 2 last blocks (freed tail first),
    so `low` resumes on a hit of its own first 2 blocks: a preempted hit, not a hit."""
    rng = random.Random(17)
    low, high = _tokens(rng, 60), _tokens(rng, 20)  # 3 full blocks + 12 tokens; 1 full block + 4
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    solo = LLM(llama_dir, block_size=BLOCK)
    expected = [solo.generate(prompt, params)[0].token_ids for prompt in (low, high)]

    llm = LLM(llama_dir, block_size=BLOCK, num_blocks=4, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("low", low, params, priority=5)
    outputs = {"low": list(engine.step())}  # the whole prompt and a first token: 4 blocks held
    assert engine.stats().num_kv_blocks_used == 4
    engine.add_request("high", high, params, priority=0)
    outputs["high"] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    stats = engine.stats()
    assert stats.num_preemptions == 1
    assert [[t for o in outputs[r] for t in o.token_ids] for r in ("low", "high")] == expected
    # First lookups: both prompts, nothing cached. Resumed: low's prompt and first token, 2 blocks cached.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (60 + 20, 0)
    assert (stats.prefix_cache_preempted_queries, stats.prefix_cache_preempted_hits) == (61, 2 * BLOCK)
    assert stats.num_prompt_tokens_computed == 60 + 20 + (60 - 2 * BLOCK)  # the resumed past its hit
    assert outputs["low"][-1].usage.cached_tokens == 0  # cached at its first admission only


def test_a_request_wanting_prompt_logprobs_is_no_lookup(llama_dir):
    """It never reads the cache (cached positions have no logits), so it is no query: its 40 tokens were
    counted as queries that missed, lowering the hit rate. A request without them after it is one."""
    prompt = _tokens(random.Random(3), 40)
    llm = LLM(llama_dir, block_size=BLOCK)
    llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    stats = llm.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    llm.generate(prompt, SamplingParams(max_tokens=1))
    stats = llm.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40, 2 * BLOCK)


def test_the_preempted_lookups_are_exported_beside_the_first_ones():
    stats = EngineStats(
        num_running=1,
        num_waiting=0,
        num_kv_blocks_total=8,
        num_kv_blocks_used=2,
        num_preemptions=1,
        num_prompt_tokens_computed=0,
        num_generation_tokens=0,
        prefix_cache_queries=80,
        prefix_cache_hits=16,
        prefix_cache_preempted_queries=61,
        prefix_cache_preempted_hits=32,
    )
    text = generate_latest(ServerMetrics(lambda: stats).registry).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["sluice_prefix_cache_queries_total"] == 80
    assert samples["sluice_prefix_cache_hits_total"] == 16
    assert samples["sluice_prefix_cache_preempted_queries_total"] == 61
    assert samples["sluice_prefix_cache_preempted_hits_total"] == 32


@pytest.fixture(scope="module")
def n2_outputs(llama_dir) -> list[RequestOutput]:
    """The engine's outputs of one greedy n = 2 request on a fresh 37-token prompt: sample 0 computes it,
    sample 1 hits its 2 full blocks."""
    llm = LLM(llama_dir, block_size=BLOCK, num_blocks=64)
    engine = llm.engine
    prompt = _tokens(random.Random(23), 37)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finals = {o.index: o.usage.cached_tokens for o in outputs if o.finished}
    assert finals == {0: 0, 1: 2 * BLOCK}
    return outputs


@pytest.mark.parametrize("last", [0, 1], ids=["sample-0-last", "sample-1-last"])
@pytest.mark.parametrize("caller_left", [False, True])
def test_an_n_sample_request_counts_sample_zeros_cached_tokens_whichever_finishes_last(
    n2_outputs, last, caller_left
):
    """The outputs as the engine gave them, the finished ones reordered so that sample `last` finishes
    last (or, caller_left, the caller leaves before sample `last` finishes)."""
    finals = {o.index: o for o in n2_outputs if o.finished}
    added = [o for o in n2_outputs if not o.finished] + [finals[1 - last]]
    if not caller_left:
        added.append(finals[last])
    progress = RequestProgress("r", num_samples=2)
    for output in added:
        progress.add(output)
    final = progress.final_output(caller_left)
    assert final.finish_reason == ("abort" if caller_left else "length")
    assert (final.usage.prompt_tokens, final.usage.cached_tokens) == (37, 0)
    assert final.usage.completion_tokens == sum(len(o.token_ids) for o in added)


@pytest.fixture(scope="module")
def observed(llama_long_dir: str):
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0)
    thread = ServerThread(long_engine_config(llama_long_dir), config).start()
    yield thread
    thread.stop()


def test_a_served_n_sample_request_counts_its_prompt_once_with_sample_zeros_cached_tokens(observed):
    """sluice_prompt_tokens / _cached_tokens count the prompt once, sample 0's way; the prefix-cache
    counters count each sample's lookup, as the engine made them."""
    prompt = _tokens(random.Random(29), 41)  # 2 full blocks + 9 tokens, not cached yet
    before = observed.metric_samples()
    with Client(observed.target) as client:
        request = generate_request(token_ids=prompt, n=2, temperature=0.0, max_tokens=4, ignore_eos=True)
        chunks = list(client.generate(request))
    observed.wait_idle()
    after = observed.metric_samples()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    usages = {c.index: c.usage for c in chunks if c.finish_reason}
    assert [usages[i].cached_tokens for i in (0, 1)] == [0, 2 * BLOCK]
    assert delta("sluice_prompt_tokens_total", tenant="default") == len(prompt)
    assert delta("sluice_cached_tokens_total", tenant="default") == usages[0].cached_tokens
    assert delta("sluice_prefix_cache_queries_total") == 2 * len(prompt)
    assert delta("sluice_prefix_cache_hits_total") == 2 * BLOCK
    assert delta("sluice_prefix_cache_preempted_queries_total") == 0
