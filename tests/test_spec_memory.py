"""A draft model's KV cache (as many blocks as the target's) and weights are inside the KV budget: on CPU the
blocks are `kv_cache_memory_bytes` over the target's and the draft's bytes per block together, and the check
against the memory left covers both caches."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

BLOCK = 16
BUDGET = 1_000_000  # bytes: no multiple of any block


def _block_bytes(checkpoint: str) -> int:
    """layers x (K, V) x kv heads x head_dim x block_size x 4 bytes (float32 on CPU), from config.json."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * BLOCK * 4


def _draft(draft_dir: str) -> SpeculativeConfig:
    return SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=draft_dir)


def test_the_kv_budget_holds_the_target_and_the_draft_model_caches(llama_dir, qwen3_dir, caplog):
    per_block = _block_bytes(llama_dir) + _block_bytes(qwen3_dir)
    assert (_block_bytes(llama_dir), _block_bytes(qwen3_dir)) == (8192, 16384)  # qwen3: head_dim 32
    expected = BUDGET // per_block
    assert expected == 40  # the target alone: 122 blocks, as many as the draft got before
    with caplog.at_level(logging.INFO, logger="sluice.engine.worker.model_runner"):
        llm = LLM(llama_dir, speculative=_draft(qwen3_dir), kv_cache_memory_bytes=BUDGET, block_size=BLOCK)
    engine = llm.engine
    assert engine.model_info.num_kv_blocks == expected
    assert engine.stats().num_kv_blocks_total == expected
    draft_runner = engine.core.speculator.proposer.runner
    assert draft_runner.num_blocks == expected == engine.core.speculator.proposer.tables.pool.num_free_blocks
    caches = [*engine.model_runner.kv_caches, *draft_runner.kv_caches]
    assert sum(k.nbytes + v.nbytes for k, v in caches) == expected * per_block <= BUDGET
    assert (
        f"KV cache: {expected} blocks of {BLOCK} tokens ({expected * BLOCK} tokens), torch.float32, 0.3 MiB; "
        "the draft model's as many, 0.6 MiB" in caplog.messages
    )
    # One line for both caches: the draft's runner allocating its own logged a second, the draft's 0.6 MiB
    # under the same words, which read as the target's cache.
    assert len([message for message in caplog.messages if message.startswith("KV cache:")]) == 1
    alone = LLM(llama_dir, kv_cache_memory_bytes=BUDGET, block_size=BLOCK)
    assert alone.engine.model_info.num_kv_blocks == BUDGET // _block_bytes(llama_dir) == 122

    # Greedy tokens are the target's alone, and the draft ran (drafts verified).
    prompts = [[(7 * i + j) % 400 + 4 for j in range(20)] for i in range(3)] + [[5, 9, 11, 13] * 6]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    speculative = [c.token_ids for c in llm.generate(prompts, params)]
    assert speculative == [c.token_ids for c in alone.generate(prompts, params)]
    assert engine.stats().num_draft_tokens > 0


@pytest.mark.parametrize(
    ("setting", "field"),
    [({"kv_cache_memory_bytes": BUDGET}, "kv_cache_memory_bytes"), ({"num_blocks": 40}, "num_blocks")],
)
def test_a_cpu_cache_of_both_models_beyond_the_memory_left_is_refused(
    llama_dir, qwen3_dir, monkeypatch, setting, field
):
    # 40 blocks: the target's cache (327,680 bytes) and the draft's (655,360) fit alone, not together.
    monkeypatch.setattr("sluice.engine.worker.model_runner.available_memory_bytes", lambda: 700_000)
    with pytest.raises(ValueError) as refused:
        LLM(llama_dir, speculative=_draft(qwen3_dir), block_size=BLOCK, **setting)
    assert str(refused.value) == (
        f"{field}: a KV cache of 0.0 GiB (target 8192 + draft model 16384 bytes a block) is more than the "
        "0.0 GiB of memory available"
    )


def test_an_fp8_kv_cache_holds_the_draft_models_keys_and_values_too(llama_dir, qwen3_dir):
    """The draft's cache took the model's dtype whatever --kv-cache-dtype said: with fp8, its float32
    blocks were 80% of the budget (97 blocks of both where 244 fit)."""
    per_block = (_block_bytes(llama_dir) + _block_bytes(qwen3_dir)) // 4  # a byte per value
    llm = LLM(
        llama_dir,
        speculative=_draft(qwen3_dir),
        kv_cache_memory_bytes=BUDGET,
        block_size=BLOCK,
        kv_cache_dtype="fp8",
    )
    engine = llm.engine
    draft_runner = engine.core.speculator.proposer.runner
    caches = [*engine.model_runner.kv_caches, *draft_runner.kv_caches]
    assert {t.dtype for cache in caches for t in cache} == {torch.float8_e4m3fn}
    assert engine.model_info.num_kv_blocks == draft_runner.num_blocks == BUDGET // per_block == 162
