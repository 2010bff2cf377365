"""Greedy outputs are identical with speculative decoding (n-gram prompt lookup) on and off, and equal
transformers' generate, on the tiny Llama, Mistral and Qwen2 checkpoints.

The runs mix chunked prefill (a 32-token budget), prefix-cache hits (a shared 3-block prefix) and
preemption (too few blocks for every request at once). Prompts repeat themselves so that the n-gram
proposer has something to propose; each test also checks that drafts were verified and some accepted
(and some rejected), so the comparison cannot pass with speculation idle.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

BLOCK = 16
MAX_TOKENS = 40
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PRESSURE = dict(block_size=BLOCK, num_blocks=13, max_num_batched_tokens=32, max_num_seqs=4)


@pytest.fixture(scope="module", params=["llama_dir", "mistral_dir", "qwen2_dir"])
def checkpoint(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(request.param)


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    tokens = lambda n: [rng.randrange(4, 512) for _ in range(n)]  # noqa: E731
    system = tokens(3 * BLOCK)
    phrase = tokens(12)
    return [
        system + phrase * 3,
        system + tokens(5) + phrase + tokens(4) + phrase[:6],
        system + tokens(30),
        tokens(9) * 4,
    ]


@pytest.fixture(scope="module")
def spec_off(checkpoint: str):
    llm = LLM(checkpoint, **PRESSURE)
    return [c.token_ids for c in llm.generate(_prompts(), PARAMS)]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_tokens_are_identical_with_ngram_speculation(checkpoint, spec_off, k):
    llm = LLM(checkpoint, speculative=SpeculativeConfig("ngram", num_speculative_tokens=k), **PRESSURE)
    completions = llm.generate(_prompts(), PARAMS)
    assert [c.token_ids for c in completions] == spec_off
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.num_kv_blocks_used == 0
    assert len(stats.draft_tokens_per_position) == k
    assert sum(c.accepted_draft_tokens for c in completions) == stats.num_accepted_draft_tokens
    assert sum(c.draft_tokens for c in completions) == stats.num_draft_tokens


def test_speculative_greedy_tokens_equal_transformers_generate(checkpoint):
    from transformers import AutoModelForCausalLM

    prompts = _prompts()
    llm = LLM(checkpoint, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4), block_size=BLOCK)
    ours = [c.token_ids for c in llm.generate(prompts, PARAMS)]
    assert llm.engine.stats().num_accepted_draft_tokens > 0
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for prompt, tokens in zip(prompts, ours, strict=True):
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            assert tokens == out[0, len(prompt) :].tolist()


def test_a_request_that_opts_out_never_verifies_drafts(llama_dir):
    llm = LLM(llama_dir, speculative=SpeculativeConfig("ngram", num_speculative_tokens=3), block_size=BLOCK)
    engine = llm.engine
    engine.add_request("opt-out", _prompts()[0], PARAMS, use_speculation=False)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_draft_tokens == 0
    llm.generate([_prompts()[0]], PARAMS)
    assert engine.stats().num_draft_tokens > 0


# Mild enough that the tiny models still repeat what the n-gram lookup drafts.
PENALTIES = [
    dict(repetition_penalty=1.05),
    dict(frequency_penalty=0.2),
    dict(presence_penalty=0.2),
    dict(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1),
]


def test_penalised_greedy_tokens_are_identical_with_ngram_speculation(checkpoint):
    """Each verify row is penalised as if the drafts before it were accepted (`SamplingRow.num_drafts`)."""
    params = [dataclasses.replace(PARAMS, **penalties) for penalties in PENALTIES]
    expected = [c.token_ids for c in LLM(checkpoint, **PRESSURE).generate(_prompts(), params)]
    llm = LLM(checkpoint, speculative=SpeculativeConfig("ngram", num_speculative_tokens=3), **PRESSURE)
    assert [c.token_ids for c in llm.generate(_prompts(), params)] == expected
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.num_preemptions > 0


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(checkpoint, spec_off, k):
    """The draft's own paged KV cache must hold exactly the target's context for this to hold."""
    spec = SpeculativeConfig("draft", num_speculative_tokens=k, draft_model=checkpoint)
    llm = LLM(checkpoint, speculative=spec, **PRESSURE)
    assert [c.token_ids for c in llm.generate(_prompts(), PARAMS)] == spec_off
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert 0 < stats.num_accepted_draft_tokens == stats.num_draft_tokens
    assert stats.num_kv_blocks_used == 0
    assert llm.engine.core.speculator.proposer.tables.num_used_blocks == 0


def test_tokens_sampled_past_a_stop_token_are_not_counted_as_generated(llama_dir):
    """A draft equal to the target has each verified run accepted whole; a stop token inside one drops
    the run's rest, which num_generation_tokens counted (5 for an output of 3)."""
    prompt = _prompts()[0]
    reference = LLM(llama_dir, **PRESSURE).generate([prompt], PARAMS)[0].token_ids
    stop_at = next(i for i in range(2, MAX_TOKENS) if reference[i] not in reference[:i])
    spec = SpeculativeConfig("draft", num_speculative_tokens=4, draft_model=llama_dir)
    llm = LLM(llama_dir, speculative=spec, **PRESSURE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=(reference[stop_at],))
    (completion,) = llm.generate([prompt], params)
    assert completion.token_ids == reference[: stop_at + 1] and completion.finish_reason == "stop"
    assert llm.engine.stats().num_generation_tokens == stop_at + 1


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from checkpoints import build_llama_checkpoint

    return build_llama_checkpoint(str(tmp_path_factory.mktemp("llama_other")), seed=5)


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_tokens_are_identical_with_a_different_draft_model(llama_dir, other_llama_dir, k):
    expected = [c.token_ids for c in LLM(llama_dir, **PRESSURE).generate(_prompts(), PARAMS)]
    spec = SpeculativeConfig("draft", num_speculative_tokens=k, draft_model=other_llama_dir)
    llm = LLM(llama_dir, speculative=spec, **PRESSURE)
    assert [c.token_ids for c in llm.generate(_prompts(), PARAMS)] == expected
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.num_kv_blocks_used == 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_n_samples_share_the_prompt_then_speculate_with_identical_tokens(llama_dir, method):
    # Samples 1.. join after sample 0's first token, hit its prompt blocks, and speculate like any request.
    prompts = _prompts()[:2]
    expected = [c.token_ids for c in LLM(llama_dir, block_size=BLOCK).generate(prompts, PARAMS)]
    draft = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=llama_dir)
    ngram = SpeculativeConfig("ngram", num_speculative_tokens=3)
    llm = LLM(llama_dir, speculative=draft if method == "draft" else ngram, block_size=BLOCK)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    completions = llm.generate(prompts, params)
    assert [c.token_ids for c in completions] == [e for e in expected for _ in range(3)]
    assert [c.index for c in completions] == [0, 1, 2] * 2
    last_block = [(len(p) - 1) % BLOCK + 1 for p in prompts]  # of the prompt: what samples 1.. compute
    assert [c.prompt_tokens_computed for c in completions] == [
        n for p, last in zip(prompts, last_block, strict=True) for n in (len(p), last, last)
    ]
    stats = llm.engine.stats()
    assert stats.num_accepted_draft_tokens > 0 and stats.num_kv_blocks_used == 0
    if method == "draft":
        assert llm.engine.core.speculator.proposer.tables.num_used_blocks == 0
