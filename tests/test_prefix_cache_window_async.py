"""Prefix caching with async scheduling on a model whose every layer has the same sliding window (Mistral,
window 12): blocks that leave the window are freed at the next allocation, which with overlapped steps
comes before the update of the step that computed them. They must be registered in the prefix cache before
they are freed, or the chain of hashes breaks at block 0 and a repeated prompt finds nothing cached (as a
synchronous engine would). The hit must not change the request's output."""

from __future__ import annotations

import random

import pytest
from checkpoints import MISTRAL_WINDOW

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

BLOCK = 8
PROMPT_LEN = 64  # 8 full blocks, most of them before the window once the prompt is computed
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


@pytest.mark.parametrize("max_num_batched_tokens", [32, 256], ids=["chunked", "whole-prompt"])
def test_a_repeated_prompt_hits_the_blocks_that_left_the_window(
    mistral_windowed_dir: str, max_num_batched_tokens: int
) -> None:
    assert MISTRAL_WINDOW + BLOCK < PROMPT_LEN
    llm = LLM(
        mistral_windowed_dir,
        async_scheduling=True,
        block_size=BLOCK,
        num_blocks=64,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=4,
    )
    rng = random.Random(0)
    prompt = [rng.randrange(4, 512) for _ in range(PROMPT_LEN)]
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    # Every block but the one holding the last prompt token (whose logits are needed) is found cached.
    assert (first.cached_tokens, second.cached_tokens) == (0, PROMPT_LEN - BLOCK)
    assert second.prompt_tokens_computed == BLOCK
    stats = llm.engine.stats()
    assert (stats.prefix_cache_hits, stats.num_kv_blocks_used) == (PROMPT_LEN - BLOCK, 0)
    assert second.token_ids == first.token_ids
    for cached, computed in zip(second.logprobs, first.logprobs, strict=True):
        assert cached.sampled.logprob == pytest.approx(computed.sampled.logprob, abs=1e-4)
