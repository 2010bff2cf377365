"""The engine on Qwen3, Mistral with a 12-token sliding window and hybrid Gemma 3 (local window 8 +
global): greedy tokens equal transformers' when prompts are chunked, batched, share cached prefixes and
get preempted; an all-windowed model holds only the blocks its window reaches, however long the context."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import MISTRAL_WINDOW

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

NUM_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
CHECKPOINTS = ["qwen3_dir", "mistral_windowed_dir", "gemma3_dir"]


def _hf_greedy(directory: str, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _prompts_sharing_a_prefix(seed: int) -> list[list[int]]:
    """Eight prompts: four extend one 40-token prefix (prefix-cache hits), four are unrelated."""
    rng = random.Random(seed)
    prefix = [rng.randrange(4, 512) for _ in range(40)]
    shared = [prefix + [rng.randrange(4, 512) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    other = [[rng.randrange(4, 512) for _ in range(rng.randint(3, 60))] for _ in range(4)]
    return [p for pair in zip(shared, other, strict=True) for p in pair]


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def expected(checkpoint: str) -> list[list[int]]:
    return _hf_greedy(checkpoint, _prompts_sharing_a_prefix(seed=3), NUM_NEW)


def test_chunked_batched_with_prefix_hits_equals_transformers(checkpoint, expected):
    llm = LLM(checkpoint, max_num_batched_tokens=24, max_num_seqs=4, block_size=16)
    completions = llm.generate(_prompts_sharing_a_prefix(seed=3), GREEDY)
    assert [c.token_ids for c in completions] == expected
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 2 * 32  # prompts 4 and 6, admitted after the prefix is cached
    assert stats.num_kv_blocks_used == 0


def test_preemption_keeps_outputs_equal_to_transformers(checkpoint, expected):
    # 12 blocks of 16 tokens cannot hold 8 running requests of up to 70 tokens.
    llm = LLM(checkpoint, max_num_batched_tokens=64, max_num_seqs=8, block_size=16, num_blocks=12)
    completions = llm.generate(_prompts_sharing_a_prefix(seed=3), GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    assert [c.token_ids for c in completions] == expected
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_only_all_windowed_models_free_blocks(qwen3_dir, mistral_windowed_dir, gemma3_dir):
    directories = (qwen3_dir, mistral_windowed_dir, gemma3_dir)
    windows = [LLM(d, num_blocks=8).engine.core.scheduler.kv.sliding_window for d in directories]
    assert windows == [None, MISTRAL_WINDOW, None]  # Gemma 3 keeps full context in its global layer


def test_long_context_holds_blocks_bounded_by_the_window(mistral_windowed_dir):
    rng = random.Random(11)
    prompt = [rng.randrange(4, 512) for _ in range(180)]
    num_new = 60  # 240 tokens = 15 blocks of 16, in a cache of 5
    llm = LLM(mistral_windowed_dir, block_size=16, num_blocks=5, max_num_batched_tokens=32, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True))
    used, tokens = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.token_ids
        used.append(engine.stats().num_kv_blocks_used)
    # Chunks start at multiples of 32, so the 11 positions a chunk's first query sees before it lie in
    # one block, and the chunk fills two: 3 blocks (the scheduler's bound, for any alignment, is 4).
    assert max(used) == 3 and used[-1] == 0
    assert engine.core.scheduler.kv.num_blocks_needed(240, 32) == 4
    assert engine.stats().num_preemptions == 0
    assert tokens == _hf_greedy(mistral_windowed_dir, [prompt], num_new)[0]
