"""The engine on the Triton backend's FP8 KV cache (kernels: test_triton_fp8_kv): a tiny Llama with
`--kv-cache-dtype fp8` gives the torch backend's greedy tokens (which test_fp8_kv_cache ties to
transformers) through chunked prefill, prefix hits, preemption and a checkpoint's own scales: equal, or
parting at a near tie (the two backends' K/V may round to e4m3 differently: `fp8_greedy`)."""

from __future__ import annotations

import pytest
from fp8_checkpoints import write_fp8_checkpoint
from fp8_greedy import assert_agrees, samples, transformers_samples
from test_fp8_kv_cache import BLOCK, GREEDY, NUM_NEW, _prompts, greedy

from sluice.benchmarks.gpu.greedy_compare import Sample
from sluice.engine.frontend.llm import LLM
from sluice.engine.worker.attention.fp8_kv_cache import FP8


@pytest.fixture(scope="module")
def torch_fp8(llama_dir) -> list[Sample]:
    """The torch backend's greedy tokens with an FP8 cache (test_fp8_kv_cache ties them to transformers)."""
    return greedy(
        LLM(llama_dir, kv_cache_dtype="fp8", attention_backend="torch", block_size=BLOCK, num_blocks=64)
    )


def _triton_fp8(directory: str, **kwargs) -> LLM:
    llm = LLM(directory, kv_cache_dtype="fp8", attention_backend="triton", block_size=BLOCK, **kwargs)
    runner = llm.engine.model_runner
    assert runner.attention_backend.name == "triton" and runner.attention_backend.kv_cache_dtype == FP8
    assert all(k.dtype == v.dtype == FP8 for k, v in runner.kv_caches)
    # Every layer stores through the fused rotary + store kernel.
    assert all(layer.self_attn.attn.fuse_rotary_store for layer in runner.model.model.layers)
    return llm


def test_engine_greedy_equals_the_torch_backend_through_chunks_and_prefix_hits(llama_dir, torch_fp8):
    llm = _triton_fp8(llama_dir, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=8)
    completions = llm.generate(_prompts(), GREEDY)
    assert_agrees(samples(completions), torch_fp8)
    assert [c.cached_tokens for c in completions] == [0, 0, 3 * BLOCK, 0, 3 * BLOCK, 0]


def test_engine_greedy_through_preemption(llama_dir, torch_fp8):
    # 6 blocks: the longest request alone takes 5 (77 tokens), so running requests preempt each other.
    llm = _triton_fp8(
        llama_dir, num_blocks=6, max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False
    )
    completions = llm.generate(_prompts(), GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    assert_agrees(samples(completions), torch_fp8)


def test_engine_greedy_with_the_checkpoints_kv_scales(llama_dir, tmp_path):
    kv_scales = (0.05, 0.02)
    directory = write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8"), kv_scales=kv_scales)
    llm = _triton_fp8(directory, num_blocks=64)
    attn = llm.engine.model_runner.model.model.layers[1].self_attn.attn
    assert (attn.k_scale.item(), attn.v_scale.item()) == (pytest.approx(0.05), pytest.approx(0.02))
    torch_fp8 = LLM(
        directory, kv_cache_dtype="fp8", attention_backend="torch", block_size=BLOCK, num_blocks=64
    )
    expected = transformers_samples(directory, _prompts(), NUM_NEW, kv_scales=kv_scales)
    assert_agrees(greedy(llm), expected)
    assert_agrees(greedy(torch_fp8), expected)
