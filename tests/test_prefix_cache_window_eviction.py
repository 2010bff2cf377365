"""Prefix caching on a model whose every layer has the same sliding window (Mistral, window 12) after the
cache evicted a prompt's first blocks: those left the window first and were freed first, so they are the
first evicted under pressure, while the blocks the window reaches stay cached. A repeated prompt must
still hit those (vLLM's sliding-window manager does), with the output it had without the hit."""

from __future__ import annotations

import random

import pytest
from checkpoints import MISTRAL_WINDOW

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

BLOCK = 8
PROMPT_LEN = 64  # blocks 0..7; a hit of blocks 0..6 (56 tokens) needs 5 and 6: its next query sees 45..56
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_prompt_whose_first_block_was_evicted_hits_the_blocks_its_window_reaches(
    mistral_windowed_dir: str, async_scheduling: bool
) -> None:
    assert MISTRAL_WINDOW == 12
    # 16 blocks: the prompt's run takes blocks 0..8 and leaves the free queue 9..15, then blocks 0..6 (freed
    # as they left the window, in that order), then 8, 7 (freed at the end, tail first).
    llm = LLM(
        mistral_windowed_dir,
        async_scheduling=async_scheduling,
        block_size=BLOCK,
        num_blocks=16,
        max_num_batched_tokens=256,
        max_num_seqs=4,
    )
    rng = random.Random(1)
    prompt = [rng.randrange(4, 512) for _ in range(PROMPT_LEN)]
    first = llm.generate([prompt], GREEDY)[0]
    # Another prompt of 8 blocks, one step: it takes the 7 never-used blocks and block 0.
    other = [rng.randrange(4, 512) for _ in range(PROMPT_LEN)]
    llm.generate([other], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert llm.engine.stats().prefix_cache_evictions == 1
    second = llm.generate([prompt], GREEDY)[0]
    assert (first.cached_tokens, second.cached_tokens) == (0, PROMPT_LEN - BLOCK)
    assert second.prompt_tokens_computed == BLOCK
    assert second.token_ids == first.token_ids
    for cached, computed in zip(second.logprobs, first.logprobs, strict=True):
        assert cached.sampled.logprob == pytest.approx(computed.sampled.logprob, abs=1e-4)
