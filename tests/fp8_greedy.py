"""Greedy tokens of an FP8 engine against transformers' on the same checkpoint, where both round values to
e4m3 on the way (activations per token, group or tensor; K/V in an FP8 cache).

Sluice's CPU kernels and torch's agree to a few 1e-6 on float models (their sums run in other orders, and
differ again between machines), but a value that lands within that of a rounding boundary rounds one way
in one and the other way in the other: that value then differs by an e4m3 step (1/16 to 1/8 of it), and
what follows moves by up to ~0.1 nats. Measured on 7 such checkpoints of the tiny models, ~1,500 positions
teacher-forced: mostly no difference at all, at most 0.07 nats (0.10 on the TP test's prompts, which
parted on an AVX2 machine at a 0.04-nat tie after passing on AVX-512 ones), against a mean of 0.26 and a
largest of 1.1 between FP8 and the float model. Where two tokens are that close, either may rightly be
picked, and the sequences part there. So a sample agrees when it equals transformers' or parts from it at a
near tie: each token among the other's top logprobs, the two within NEAR_TIE_NATS on both sides (the rule
of vLLM's `check_logprobs_close`, and of the GPU check's `greedy_compare`); anything else fails.
"""

from __future__ import annotations

import torch
from fp8_checkpoints import greedy_steps

from sluice.benchmarks.gpu.greedy_compare import Sample, compare_greedy, summarize
from sluice.engine.frontend.llm import LLM, Completion
from sluice.engine.sampling_params import SamplingParams

NUM_TOP = 5
NEAR_TIE_NATS = 0.2  # twice the largest difference measured between the two (above)


def greedy_params(max_tokens: int) -> SamplingParams:
    """Greedy, with the top logprobs that `agrees_with_transformers` compares at a parting."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=NUM_TOP)


def samples(completions: list[Completion]) -> list[Sample]:
    """Completions of `greedy_params` as greedy_compare's samples."""
    return [
        {"tokens": c.token_ids, "top": [[[t.token_id, t.logprob] for t in lp.top] for lp in c.logprobs]}
        for c in completions
    ]


def transformers_samples(
    directory: str, prompts: list[list[int]], max_tokens: int, kv_scales: tuple[float, float] | None = None
) -> list[Sample]:
    """transformers' greedy tokens on `directory` (see `fp8_checkpoints.transformers_greedy`), with its top
    NUM_TOP logprobs at each step."""
    return [
        {"tokens": [int(step.argmax()) for step in steps], "top": [_top(step) for step in steps]}
        for steps in greedy_steps(directory, prompts, max_tokens, kv_scales)
    ]


def _top(logits: torch.Tensor) -> list[list[float]]:
    top = torch.log_softmax(logits.float(), dim=-1).topk(NUM_TOP)
    return [[int(token), float(value)] for token, value in zip(top.indices, top.values, strict=True)]


def assert_agrees(candidate: list[Sample], reference: list[Sample]) -> None:
    """Every candidate sample equals the reference's or parts from it at a near tie."""
    summary = summarize(compare_greedy(reference, candidate, NEAR_TIE_NATS))
    assert summary["mismatch"] == 0, summary


def agrees_with_transformers(
    llm: LLM,
    directory: str,
    prompts: list[list[int]],
    max_tokens: int,
    kv_scales: tuple[float, float] | None = None,
) -> None:
    """Asserts that `llm`'s greedy samples of `prompts` agree with transformers' on `directory`."""
    assert_agrees(
        samples(llm.generate(prompts, greedy_params(max_tokens))),
        transformers_samples(directory, prompts, max_tokens, kv_scales),
    )
