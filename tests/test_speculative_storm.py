"""No KV leaks with speculative decoding: requests aborted between speculative steps (drafts proposed,
lookahead blocks reserved, rejected positions rolled back) return every block."""

from __future__ import annotations

import random

import pytest

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_aborts_in_the_middle_of_speculative_steps_return_every_block(llama_dir, method):
    rng = random.Random(8)
    draft_model = llama_dir if method == "draft" else None
    llm = LLM(
        llama_dir,
        block_size=16,
        num_blocks=40,
        max_num_batched_tokens=48,
        max_num_seqs=16,
        speculative=SpeculativeConfig(method, num_speculative_tokens=4, draft_model=draft_model),
    )
    engine = llm.engine
    live: list[str] = []
    aborted_with_drafts = 0
    for i in range(100 if method == "ngram" else 40):
        phrase = [rng.randrange(4, 512) for _ in range(rng.randint(3, 10))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=40, ignore_eos=True)
        engine.add_request(f"r{i}", phrase * rng.randint(2, 6), params, priority=rng.randint(0, 2))
        live.append(f"r{i}")
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if rng.random() < 0.4:
            victim = live.pop(rng.randrange(len(live)))
            request = engine.core.scheduler.get_request(victim)
            aborted_with_drafts += request is not None and bool(request.spec_token_ids)
            engine.abort([victim])
    engine.abort(live)
    stats = engine.stats()
    assert aborted_with_drafts > 0
    assert stats.num_draft_tokens > 0 and stats.num_accepted_draft_tokens > 0
    assert stats.num_kv_blocks_used == 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.has_unfinished_requests()
    assert engine.core.scheduler.kv.pool.num_free_blocks == stats.num_kv_blocks_total
    if method == "draft":
        assert engine.core.speculator.proposer.tables.num_used_blocks == 0  # the draft's own cache too
