"""Async scheduling under tensor parallelism (`--async-scheduling --tensor-parallel-size N`), on CPU with
gloo: step N+1 is launched before step N's tokens reach the host; rank 0 sampled them, and every rank's
runner receives them from rank 0's device by the group's broadcast as N+1 starts, to fill its
placeholders (`ExecuteModel.tokens_before`). A worker that filled them otherwise would embed other
tokens and send the other ranks wrong partial sums.

The tiny Llama on 2 ranks, overlapped, against the same 2 ranks stepping synchronously: every token and
logprob must be equal, since with 2 ranks each all-reduced element is one addition, the same whatever
else the step batches (with 3 or more, gloo's summation order follows the tensor's size: PARALLELISM.md),
and the CPU kernels compute a row alike in any batch (as the one-rank async tests rely on);
tests/test_tensor_parallel.py holds 2 ranks' greedy tokens to one rank's and transformers'. A mix of
chunked prompts sharing a prefix, preemption, n = 2, prompt logprobs, seeded sampling, penalties and
min_tokens; then ngram speculation paused at a batch size, so that synchronous (verify) steps and
overlapped ones alternate.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from test_tensor_parallel import _prompts  # four share a 40-token prefix, four do not

from sluice.engine.config import EngineConfig, ParallelConfig, SpeculativeConfig
from sluice.engine.executor.messages import ExecuteModel, decode_driver_message
from sluice.engine.frontend.llm import LLM, Completion
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(900)

NUM_NEW = 12
# 12 blocks of 16 tokens for 8 running requests: preemption; 24 tokens a step: chunked prompts.
MIXED = dict(block_size=16, max_num_batched_tokens=24, max_num_seqs=8, num_blocks=12)


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=NUM_NEW, ignore_eos=True)
    return [
        replace(greedy, n=2),
        seeded,
        replace(greedy, prompt_logprobs=3),
        replace(greedy, repetition_penalty=2.0, frequency_penalty=1.0),
        replace(seeded, seed=4, n=2),
        replace(greedy, min_tokens=NUM_NEW, ignore_eos=False),
        greedy,
        replace(seeded, seed=5, presence_penalty=1.0),
    ]


def _count_tokens_before(llm: LLM) -> Counter[str]:
    """Counts the step messages rank 0 broadcast to its workers, by whether they carried the step before's
    tokens ("overlapped") or not ("synchronous"), as the workers decode them."""
    counts: Counter[str] = Counter()
    workers = llm.engine.model_runner.workers
    broadcast = workers.broadcast

    def counting_broadcast(message: bytes) -> None:
        decoded = decode_driver_message(message)
        if isinstance(decoded, ExecuteModel):
            counts["overlapped" if decoded.tokens_before is not None else "synchronous"] += 1
        broadcast(message)

    workers.broadcast = counting_broadcast
    return counts


def _run(directory: str, async_scheduling: bool, prompts=None, params=None, **kwargs):
    """(completions, the engine's stats, step messages counted by kind) of `prompts` (the mix's by
    default) on 2 ranks."""
    llm = LLM(directory, tensor_parallel_size=2, async_scheduling=async_scheduling, **MIXED, **kwargs)
    try:
        counts = _count_tokens_before(llm)
        completions = llm.generate(prompts or _prompts(), params or _params())
        return completions, llm.engine.stats(), counts
    finally:
        llm.engine.model_runner.shutdown()


def _summary(completions: list[Completion]) -> list[tuple]:
    return [(c.token_ids, c.finish_reason, c.stop_reason) for c in completions]


@pytest.fixture(scope="module")
def synchronous(llama_dir):
    return _run(llama_dir, False)


def test_overlapped_steps_give_the_synchronous_outputs(llama_dir, synchronous):
    expected, expected_stats, expected_counts = synchronous
    got, stats, counts = _run(llama_dir, True)
    assert _summary(got) == _summary(expected)
    assert expected_counts["overlapped"] == 0 and expected_counts["synchronous"] > 0
    assert counts["overlapped"] > counts["synchronous"] > 0, counts  # most steps had tokens in flight
    # Preempted (not always where the synchronous engine is: a step in flight holds its blocks), prefix
    # hits, nothing left in the cache.
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_generation_tokens == expected_stats.num_generation_tokens
    assert stats.num_kv_blocks_used == 0
    (expected_logprobs,) = [c.prompt_logprobs for c in expected if c.prompt_logprobs]
    (got_logprobs,) = [c.prompt_logprobs for c in got if c.prompt_logprobs]
    assert got_logprobs == expected_logprobs


def test_speculation_paused_by_batch_size_alternates_verify_and_overlapped_steps(llama_dir):
    """Self-repeating prompts (the ngram proposer finds drafts), greedy, of staggered lengths: while 3 or
    more requests run no drafts are proposed and the steps overlap; once fewer run, the steps verify
    drafts synchronously. Tokens stay those of the synchronous engine without speculation."""
    rng = random.Random(31)
    prompts = [[rng.randrange(4, 500) for _ in range(9)] * 3 for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 6, 8, 36, 10, 12)]
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3, disable_by_batch_size=3
    )
    expected, _, _ = _run(llama_dir, False, prompts, params)
    got, stats, counts = _run(llama_dir, True, prompts, params, speculative=spec)
    assert _summary(got) == _summary(expected)
    assert stats.num_draft_tokens > 0  # speculated below the limit
    assert counts["overlapped"] > 0 and counts["synchronous"] > 0, counts
    assert stats.num_kv_blocks_used == 0


def test_async_scheduling_with_ranks_is_accepted_and_off_unless_asked():
    ranks = ParallelConfig(tensor_parallel_size=2)
    assert EngineConfig(async_scheduling=True, parallel=ranks).schedules_async(None)
    assert not EngineConfig(parallel=ranks).schedules_async(None)
