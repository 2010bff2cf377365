"""Async scheduling launches step N+1 while step N runs: nothing in that launch may wait for the device,
or N+1's inputs and sampling would queue only once N (and N+1's own forward) is done, and the step would
no longer overlap. Checked on the device the tests run on: on CUDA under torch's sync debug mode set to
"error" (the GPU check runs this file, `sluice.benchmarks.gpu.kernel_test_files`); on a CPU, where the mode
is CUDA's, only the tokens are checked.

First the sampler alone, with rows whose penalties and min_tokens count a token in flight (the token step
N samples, on the device, not yet in the row's outputs): the tokens of the same rows with it on the host.
Then whole launches of the engine, for the requests that overlap. Last, speculative decoding's two
waits a step, once each by design: a draft model's k draft steps queue before the proposal takes its
drafts, and a verify step's sampled requests are verified on the device before the step takes the
counts accepted and the tokens; and that wait comes at the next step, the verify step's launch waiting for
nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

import torch

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sample.sampler import Sampler, SamplingRow
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.scheduler_output import PLACEHOLDER_TOKEN_ID

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 64
PROMPT = [4, 5]
STOP = 9
T = TypeVar("T")


@contextmanager
def no_device_waits() -> Iterator[None]:
    """On CUDA: any call that waits for the device raises."""
    if DEVICE.type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def waiting_for_nothing(launch: Callable[..., T], launched: list[T]) -> Callable[..., T]:
    """`launch` run under `no_device_waits`, each of its results kept in `launched`."""

    def wrapped(*args: Any) -> T:
        with no_device_waits():
            result = launch(*args)
        launched.append(result)
        return result

    return wrapped


def _case() -> tuple[torch.Tensor, list[SamplingParams], list[list[int]], list[int]]:
    """Logits, params, host outputs and the tokens in flight of rows where counting the token in flight
    changes the pick: each row's best raw logit is what its penalty or min_tokens holds back with it."""
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    held = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=3, stop_token_ids=[STOP])
    rows = [
        # (params, host outputs, token in flight, the raw logits' best)
        (SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=100.0), [1], 7, 7),
        (SamplingParams(temperature=0.0, max_tokens=16, frequency_penalty=2.0), [3], 3, 3),
        (held, [2], 4, STOP),  # 2 outputs with the one in flight: the stop token is held back
        (held, [2, 2], 4, STOP),  # 3: it is not
        (SamplingParams(temperature=0.7, seed=11, max_tokens=16, presence_penalty=2.0), [5], 6, 6),
        (greedy, [1], 8, 8),  # nothing counts its outputs: the token in flight changes nothing
        # Nor here, but their processors run in the same step without waiting either.
        (SamplingParams(temperature=0.0, max_tokens=16, logit_bias={10: 30.0}), [1], 8, 8),
        (SamplingParams(temperature=0.0, max_tokens=16, allowed_token_ids=[20, 21]), [1], 8, 8),
    ]
    for i, (*_, best) in enumerate(rows):
        logits[i, best] = 12.0 if i != 1 else 10.0
    logits[1, 11] = 7.0  # frequency 2 on token 3, twice with the one in flight: 10 - 4 < 7 < 10 - 2
    params = [r[0] for r in rows]
    return logits.to(DEVICE), params, [r[1] for r in rows], [r[2] for r in rows]


def test_penalised_and_min_tokens_rows_count_their_token_in_flight_without_waiting() -> None:
    logits, params, outputs, in_flight = _case()
    token_in_flight = torch.tensor(in_flight, device=DEVICE)
    rows = [
        SamplingRow(f"r{i}", p, PROMPT, out, token_in_flight=token_in_flight[i : i + 1])
        for i, (p, out) in enumerate(zip(params, outputs, strict=True))
    ]
    sampler = Sampler()
    with no_device_waits():
        got = sampler.sample_no_sync(logits, rows)
        # A second step: the kept counts took nothing from the token in flight.
        again = sampler.sample_no_sync(logits, rows)
    on_host = [
        SamplingRow(f"r{i}", p, PROMPT, [*out, token])
        for i, (p, out, token) in enumerate(zip(params, outputs, in_flight, strict=True))
    ]
    expected = Sampler().sample_no_sync(logits, on_host).tolist()
    assert got.tolist() == expected
    assert again.tolist()[:4] == expected[:4]  # the greedy rows (the seeded one draws afresh)
    stale = [
        SamplingRow(f"r{i}", p, PROMPT, out) for i, (p, out) in enumerate(zip(params, outputs, strict=True))
    ]
    without = Sampler().sample_no_sync(logits, stale).tolist()
    assert [g != w for g, w in zip(expected, without, strict=True)][:4] == [True, True, False, True]
    assert expected[0] != 7 and expected[1] == 11 and expected[2] != STOP and expected[3] == STOP
    assert expected[5:] == without[5:] == [8, 10, 20 + int(logits[7, 21] > logits[7, 20])]


def test_an_engine_launch_waits_for_nothing_and_its_steps_give_the_synchronous_tokens(llama_dir) -> None:
    """Every launch of an async engine (inputs with placeholders, forward, sampling, the copy of its
    tokens to the host) for the requests that overlap: plain and penalised, min_tokens, seeded draws with
    top_k / top_p, logprobs, n samples, logit_bias and allowed_token_ids. Each runs to max_tokens, so the
    synchronous engine's steps hold the same rows and a GPU's kernels give the same bits."""
    rng = random.Random(41)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(3, 40))] for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    params = [
        greedy,
        replace(greedy, repetition_penalty=1.5, frequency_penalty=0.5),
        replace(greedy, min_tokens=6),
        replace(greedy, temperature=0.8, seed=3, top_k=20, top_p=0.9, presence_penalty=0.5),
        replace(greedy, logprobs=2),
        replace(greedy, temperature=1.0, seed=4, n=2),
        replace(greedy, logit_bias={7: 5.0}),
        replace(greedy, allowed_token_ids=list(range(100, 300))),
    ]
    expected = LLM(llama_dir, async_scheduling=False).generate(prompts, params)
    llm = LLM(llama_dir, async_scheduling=True)
    core = llm.engine.core
    launched = []
    core._launch = waiting_for_nothing(core._launch, launched)
    got = llm.generate(prompts, params)
    overlapped = [
        step
        for step in launched
        if any(s.token_ids[-1] == PLACEHOLDER_TOKEN_ID for s in step.scheduler_output.scheduled)
    ]
    summary = [(c.token_ids, c.finish_reason, c.logprobs) for c in got]
    assert summary == [(c.token_ids, c.finish_reason, c.logprobs) for c in expected]
    assert len(overlapped) >= greedy.max_tokens - 1  # every decode step after the first
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_a_draft_model_queues_its_k_draft_steps_and_waits_once_for_their_drafts(llama_dir) -> None:
    """The draft proposer feeds each draft to the next draft step on the device (a placeholder filled from
    the step before's ids) and takes the k drafts to the host together: its launches wait for nothing, for
    greedy and seeded rows with top_k / top_p and for the rows the draft processors mask (min_tokens,
    logit_bias, allowed_token_ids). With the target as its own draft the target accepts every draft, and
    the greedy rows' tokens are the engine's without speculation (on a CPU, where the verify and draft
    steps round as the plain ones do)."""
    rng = random.Random(43)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [
        greedy,
        replace(greedy, temperature=0.8, seed=5, top_k=20, top_p=0.9),
        replace(greedy, min_tokens=8, stop_token_ids=[7, 8]),
        replace(greedy, logit_bias={7: 5.0}),
        replace(greedy, allowed_token_ids=list(range(100, 300))),
        replace(greedy, temperature=1.0),
    ]
    spec = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=llama_dir)
    llm = LLM(llama_dir, speculative=spec)
    proposer = llm.engine.core.speculator.proposer
    launched = []
    proposer._launch_drafts = waiting_for_nothing(proposer._launch_drafts, launched)
    got = llm.generate(prompts, params)
    assert launched and max(len(steps) for steps in launched) == 3
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > 0 and stats.num_kv_blocks_used == 0
    if DEVICE.type == "cpu":
        assert stats.num_accepted_draft_tokens == stats.num_draft_tokens
        expected = LLM(llama_dir).generate(prompts, params)
        greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0.0]  # sampled rows draw otherwise
        assert [got[i].token_ids for i in greedy_rows] == [expected[i].token_ids for i in greedy_rows]


def test_a_verify_step_s_sampled_requests_are_verified_waiting_once(llama_dir) -> None:
    """The rejection sampler verifies a step's sampled requests together (n-gram drafts: point masses),
    queuing the acceptance tests, the residuals and the draws without waiting for them; then the step
    waits once. Seeded requests then give the same tokens in the same schedule, run after run."""
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [12, 13] * 10, list(range(20, 44))]
    sampled = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
    params = [
        replace(sampled, seed=1),
        replace(sampled, seed=2, top_k=20, top_p=0.9),
        replace(sampled, seed=3, logprobs=2),
        replace(sampled, temperature=0.0),
    ]
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3)
    runs = []
    for _ in range(2):
        llm = LLM(llama_dir, speculative=spec)
        rejection_sampler = llm.engine.core.rejection_sampler
        launched = []
        rejection_sampler._launch_random = waiting_for_nothing(rejection_sampler._launch_random, launched)
        got = llm.generate(prompts, params)
        stats = llm.engine.stats()
        assert launched and stats.num_draft_tokens > 0 and stats.num_kv_blocks_used == 0
        runs.append([(c.token_ids, c.logprobs) for c in got])
    assert runs[0] == runs[1]


def test_a_verify_step_s_launch_waits_for_nothing_and_is_sampled_at_the_next_step(llama_dir) -> None:
    """Under async scheduling a step that verifies n-gram drafts is launched (inputs, forward) without
    waiting for the device, and sampled by the next step, after the outputs of the step before were
    returned: the wait for its forward is that sampling's. Greedy and seeded requests give the synchronous
    engine's tokens."""
    rng = random.Random(47)
    phrase = [rng.randrange(4, 500) for _ in range(8)]
    prompts = [phrase * 4, [rng.randrange(4, 500) for _ in range(6)] * 5]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    params = [greedy, replace(greedy, temperature=0.8, seed=7, top_k=30)]
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3)
    expected = LLM(llama_dir, speculative=spec, async_scheduling=False).generate(prompts, params)
    llm = LLM(llama_dir, speculative=spec, async_scheduling=True)
    core = llm.engine.core
    launched = []
    core._launch = waiting_for_nothing(core._launch, launched)
    got = llm.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    verifying = [step for step in launched if any(s.spec_token_ids for s in step.scheduler_output.scheduled)]
    assert verifying and all(step.sampled is not None for step in verifying)  # each sampled since
    assert llm.engine.stats().num_accepted_draft_tokens > 0
    assert llm.engine.stats().num_kv_blocks_used == 0
