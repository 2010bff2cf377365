"""Prefix caching, priority preemption and aborts, seen from the engine (issue: KV memory under pressure)."""

from __future__ import annotations

import random

import pytest

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

BLOCK = 16


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 512) for _ in range(n)]


@pytest.fixture(scope="module")
def shared_prompts() -> list[list[int]]:
    rng = random.Random(11)
    system = _tokens(rng, 3 * BLOCK + 5)  # not a multiple of the block size
    return [system + _tokens(rng, rng.randint(3, 20)) for _ in range(4)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=50, seed=123, max_tokens=10, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_prefix_caching_changes_no_output_and_skips_prefill(llama_dir, shared_prompts, params):
    results = {}
    for caching in (True, False):
        llm = LLM(llama_dir, block_size=BLOCK, enable_prefix_caching=caching)
        first = llm.generate(shared_prompts[0], params)
        computed_after_first = llm.engine.stats().num_prompt_tokens_computed
        rest = llm.generate(shared_prompts[1:], params)
        stats = llm.engine.stats()
        results[caching] = (first + rest, stats.num_prompt_tokens_computed - computed_after_first, stats)
    cached, uncached = results[True], results[False]
    assert [c.token_ids for c in cached[0]] == [c.token_ids for c in uncached[0]]
    assert cached[0][0].cached_tokens == 0
    assert all(c.cached_tokens == 3 * BLOCK for c in cached[0][1:])
    assert all(c.cached_tokens == 0 for c in uncached[0])
    assert uncached[1] == sum(len(p) for p in shared_prompts[1:])
    assert cached[1] == uncached[1] - 3 * (3 * BLOCK)
    assert cached[2].prefix_cache_hits == 3 * 3 * BLOCK
    assert cached[2].prefix_cache_queries == sum(len(p) for p in shared_prompts)
    assert uncached[2].prefix_cache_hits == 0


def test_salted_requests_share_nothing(llama_dir, shared_prompts):
    llm = LLM(llama_dir, block_size=BLOCK)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, salt in enumerate(("tenant-a", "tenant-b")):
        engine.add_request(f"s{i}", shared_prompts[0], params, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.stats().prefix_cache_hits == 0
    engine.add_request("s2", shared_prompts[1], params, cache_salt="tenant-b")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].usage.cached_tokens == 3 * BLOCK


def test_high_priority_request_preempts_a_low_priority_one(llama_dir):
    rng = random.Random(5)
    low = [_tokens(rng, 44) for _ in range(3)]
    urgent = _tokens(rng, 60)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    solo = LLM(llama_dir, block_size=BLOCK)
    expected = [solo.generate(p, params)[0].token_ids for p in [*low, urgent]]

    # The three low-priority requests take 3 blocks each (44 tokens + a few outputs < 48), leaving 3
    # free blocks: too few for the urgent 60-token prompt (4 blocks) unless one of them is preempted.
    llm = LLM(llama_dir, block_size=BLOCK, num_blocks=12, max_num_seqs=4, enable_prefix_caching=False)
    engine = llm.engine
    for i, prompt in enumerate(low):
        engine.add_request(f"low{i}", prompt, params, priority=5)
    outputs = {}
    for _ in range(3):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    assert engine.stats().num_running == 3
    engine.add_request("urgent", urgent, params, priority=0)
    steps_until_start = 0
    while engine.core.scheduler.get_request("urgent").num_computed_tokens == 0:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
        steps_until_start += 1
    assert steps_until_start <= 2
    assert engine.stats().num_preemptions == 1
    assert engine.core.scheduler.get_request("low2").num_preemptions == 1  # the newest of the worst priority
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    assert [outputs[f"low{i}"] for i in range(3)] + [outputs["urgent"]] == expected
    assert engine.stats().num_kv_blocks_used == 0


def test_aborting_100_requests_in_random_states_returns_every_block(llama_dir):
    rng = random.Random(3)
    llm = LLM(llama_dir, block_size=BLOCK, num_blocks=40, max_num_batched_tokens=48, max_num_seqs=16)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    live: list[str] = []
    for i in range(100):
        engine.add_request(f"r{i}", _tokens(rng, rng.randint(5, 80)), params, priority=rng.randint(0, 2))
        live.append(f"r{i}")
        if rng.random() < 0.5:
            engine.step()
        if rng.random() < 0.3:
            victim = live.pop(rng.randrange(len(live)))
            engine.abort([victim])
    engine.abort(live)
    stats = engine.stats()
    assert stats.num_kv_blocks_used == 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.has_unfinished_requests()
    pool = engine.core.scheduler.kv.pool
    assert pool.num_free_blocks == stats.num_kv_blocks_total
