"""Async scheduling (`async_scheduling=True`): step N+1 is scheduled and launched before step N's tokens
are on the host, its placeholders filled from N's sampled tokens on the device.

First the `AsyncScheduler` alone, driven overlapped against `scheduler_driver.PagedFakeModel` (a paged
cache of token ids: a wrong placeholder, block table or recompute changes the tokens); then the engine on
the tiny checkpoints against the synchronous engine and `transformers`: chunked prefill mixed with
decodes, EOS / stop tokens / stop strings / max_tokens / max_model_len finishing while the next step is
in flight, aborts in flight (blocks back, no token after), preemption under KV pressure, prefix hits,
n > 1, logprobs, a failing sampler, and the requests that make a step synchronous (speculation,
structured output, penalties, min_tokens). The in-process engine tests also check that placeholders were
used (or, for what must step synchronously, that none was), so none can pass with the overlap idle; the
last two run the engine core process and a real gRPC server. On CPU the "device" is synchronous: these
are correctness tests.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from checkpoints import EOS_ID
from scheduler_driver import PagedFakeModel, check_invariants, make_request, reference_output, tokens
from service_harness import UNENDING, ServerThread, long_engine_config

from sluice import generate_request
from sluice.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from sluice.engine.core.launched_step import needs_step_tokens
from sluice.engine.faults import InjectedFault
from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.engine.frontend.llm import LLM
from sluice.engine.request import RequestStatus
from sluice.engine.sample.grammar_mask import GrammarMask
from sluice.engine.sample.logits_processors import counts_outputs
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.async_scheduler import AsyncScheduler
from sluice.engine.scheduler.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from sluice.engine.structured.constraint import Constraint
from sluice.engine.worker.input_batch import SampledTokenIds, build_model_inputs, fill_placeholders
from sluice.service.engine_args import add_engine_arguments, engine_config_from_args
from sluice.v1 import sluice_pb2 as pb

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PENALISED = SamplingParams(
    temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=1.0
)
CONSTRAINED = SamplingParams(temperature=0.0, max_tokens=12, constraint=Constraint(regex="[a-z ]{30,60}"))


# ---- the scheduler, overlapped, against a paged fake model ---------------------------------------


class OverlappedDriver:
    """Runs an AsyncScheduler as the engine does: schedule N+1, "launch" it (the fake model runs it at
    once, its placeholders taken from N's sampled tokens), then update N."""

    def __init__(self, scheduler: AsyncScheduler) -> None:
        self.scheduler = scheduler
        self.model = PagedFakeModel(scheduler.block_size)
        self.in_flight: tuple[SchedulerOutput, dict[str, int]] | None = None
        self.outputs: dict[str, list[int]] = {}

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        launched = None
        if out.scheduled:
            before = {} if self.in_flight is None else self.in_flight[1]
            launched = (out, self.model.execute(_filled(out, before)))
        self.finish_in_flight()
        self.in_flight = launched
        return out

    def finish_in_flight(self) -> None:
        if self.in_flight is None:
            return
        out, sampled = self.in_flight
        self.in_flight = None
        updated = self.scheduler.update_from_output(out, {k: [v] for k, v in sampled.items()})
        for request in updated:
            self.outputs[request.request_id] = list(request.output_token_ids)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
            check_invariants(self.scheduler)
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def _filled(out: SchedulerOutput, sampled_before: dict[str, int]) -> SchedulerOutput:
    """`out` with each placeholder replaced by the token the step before sampled (the runner's job)."""
    scheduled = []
    for s in out.scheduled:
        if s.token_ids and s.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            s = dataclasses.replace(s, token_ids=(*s.token_ids[:-1], sampled_before[s.request_id]))
        assert PLACEHOLDER_TOKEN_ID not in s.token_ids
        scheduled.append(s)
    return dataclasses.replace(out, scheduled=tuple(scheduled))


def _scheduler(
    num_blocks: int, budget: int = 64, max_num_seqs: int = 8, max_model_len: int = 1024
) -> AsyncScheduler:
    return AsyncScheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        CacheConfig(block_size=8),
        num_blocks,
        max_model_len=max_model_len,
    )


def test_the_next_decode_is_scheduled_with_a_placeholder_before_the_update():
    scheduler = _scheduler(num_blocks=16)
    request = make_request("a", tokens(10, start=3), max_tokens=5)
    scheduler.add_request(request)
    first = scheduler.schedule()  # the whole prompt; its token is sampled in flight
    assert [(s.token_ids, s.start_position, s.sample) for s in first.scheduled] == [
        (tuple(range(3, 13)), 0, True)
    ]
    second = scheduler.schedule()  # before first's update: decodes the token first samples
    assert [(s.token_ids, s.start_position, s.sample) for s in second.scheduled] == [
        ((PLACEHOLDER_TOKEN_ID,), 10, True)
    ]
    assert (request.num_computed_tokens, scheduler.num_in_flight(request), request.num_tokens) == (11, 2, 10)
    scheduler.update_from_output(first, {"a": [77]})
    assert (request.output_token_ids, request.num_computed_tokens, scheduler.num_in_flight(request)) == (
        [77],
        11,
        1,
    )
    with pytest.raises(ValueError, match="^out: async updates must come in the order the steps were"):
        scheduler.update_from_output(first, {"a": [78]})
    scheduler.update_from_output(second, {"a": [78]})
    assert request.output_token_ids == [77, 78] and scheduler.num_in_flight(request) == 0


def test_a_request_its_steps_in_flight_finish_is_not_scheduled_again():
    scheduler = _scheduler(num_blocks=16)
    request = make_request("a", tokens(10), max_tokens=2)
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()  # samples output 2 of 2
    assert [s.request_id for s in second.scheduled] == ["a"]
    assert scheduler.schedule().is_empty  # 2 tokens in flight: max_tokens is reached whatever they are
    scheduler.update_from_output(first, {"a": [5]})
    assert scheduler.schedule().is_empty  # still one in flight that ends it
    scheduler.update_from_output(second, {"a": [6]})
    assert request.status is RequestStatus.FINISHED_LENGTH and request.output_token_ids == [5, 6]
    assert scheduler.num_blocks_used == 0


def test_a_request_its_steps_in_flight_bring_to_max_model_len_is_not_scheduled_again():
    scheduler = _scheduler(num_blocks=16, max_model_len=12)
    request = make_request("a", tokens(10), max_tokens=8)
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert [s.start_position for s in second.scheduled] == [10]
    assert scheduler.schedule().is_empty  # 10 tokens + 2 in flight = max_model_len
    scheduler.update_from_output(first, {"a": [5]})
    assert scheduler.schedule().is_empty
    scheduler.update_from_output(second, {"a": [6]})
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 12


def test_a_result_for_a_finished_or_replaced_request_is_discarded():
    scheduler = _scheduler(num_blocks=16)
    old = make_request("a", tokens(10), max_tokens=8)
    scheduler.add_request(old)
    first = scheduler.schedule()
    scheduler.abort_requests(["a"])  # while its step is in flight
    new = make_request("a", tokens(12, start=40), max_tokens=8)  # the id reused at once
    scheduler.add_request(new)
    second = scheduler.schedule()
    assert [(s.request_id, s.start_position, len(s.token_ids)) for s in second.scheduled] == [("a", 0, 12)]
    assert scheduler.update_from_output(first, {"a": [5]}) == []
    assert old.output_token_ids == [] and new.output_token_ids == []
    assert scheduler.update_from_output(second, {"a": [9]}) == [new]
    assert new.output_token_ids == [9]


def test_a_request_preempted_while_its_token_is_in_flight_keeps_that_token():
    # Two blocks of 8: both prompts fit; a's next decode needs a third block, so b (newest) is preempted
    # while the token its prefill samples is still in flight.
    scheduler = _scheduler(num_blocks=2)
    driver = OverlappedDriver(scheduler)
    prompt_a, prompt_b = tokens(8, start=10), tokens(8, start=50)
    a, b = make_request("a", prompt_a, max_tokens=4), make_request("b", prompt_b, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    driver.step()  # both prompts, 2 tokens in flight
    second = driver.step()  # a decodes (placeholder) after preempting b; then the first step is updated
    assert [(s.request_id, s.token_ids) for s in second.scheduled] == [("a", (PLACEHOLDER_TOKEN_ID,))]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == reference_output(prompt_b, 1) and scheduler.num_in_flight(b) == 0
    driver.run()
    assert driver.outputs == {"a": reference_output(prompt_a, 4), "b": reference_output(prompt_b, 4)}
    assert scheduler.num_preemptions >= 1 and scheduler.num_blocks_used == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapped_scheduling_under_kv_pressure_and_aborts_gives_the_reference(seed):
    rng = random.Random(seed)
    scheduler = _scheduler(num_blocks=12, budget=32, max_num_seqs=6)
    driver = OverlappedDriver(scheduler)
    prompts, max_tokens, aborted = {}, {}, set()
    for i in range(30):
        prompts[f"r{i}"] = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
        max_tokens[f"r{i}"] = rng.randint(1, 12)
        scheduler.add_request(make_request(f"r{i}", prompts[f"r{i}"], max_tokens=max_tokens[f"r{i}"]))
        for _ in range(rng.randint(0, 3)):
            driver.step()
            check_invariants(scheduler)
        live = [r for r in prompts if scheduler.get_request(r) is not None]
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            scheduler.abort_requests([victim])
            aborted.add(victim)
    driver.run()
    driver.finish_in_flight()
    assert scheduler.num_preemptions > 0
    assert aborted
    for request_id, prompt in prompts.items():
        got = driver.outputs.get(request_id, [])
        assert got == reference_output(prompt, len(got)), request_id  # aborted ones stop early
        if request_id not in aborted:
            assert len(got) == max_tokens[request_id], request_id
    assert scheduler.num_blocks_used == 0


# ---- the runner's placeholder fill ----------------------------------------------------------------


def test_placeholders_are_filled_from_the_rows_of_the_step_before():
    def scheduled(request_id, token_ids, start):
        return ScheduledRequest(request_id, tuple(token_ids), start, (1, 2), sample=True)

    sampled = SampledTokenIds(torch.tensor([71, 72, 73]), {"a": 0, "b": 1, "c": 2})
    # Every row a placeholder, in the step before's order: one copy.
    out = SchedulerOutput(tuple(scheduled(r, [PLACEHOLDER_TOKEN_ID], 9) for r in "abc"), 3)
    input_ids = build_model_inputs(out, BLOCK, torch.device("cpu")).input_ids
    fill_placeholders(input_ids, out, sampled)
    assert input_ids.tolist() == [71, 72, 73]
    # Reordered, a request that left, and a prefill chunk that ends in a placeholder beside a new prompt.
    out = SchedulerOutput(
        (
            scheduled("c", [PLACEHOLDER_TOKEN_ID], 9),
            scheduled("new", [5, 6, 7], 0),
            scheduled("a", [8, PLACEHOLDER_TOKEN_ID], 4),
        ),
        6,
    )
    input_ids = build_model_inputs(out, BLOCK, torch.device("cpu")).input_ids
    fill_placeholders(input_ids, out, sampled)
    assert input_ids.tolist() == [73, 5, 6, 7, 8, 71]
    out = SchedulerOutput((scheduled("d", [PLACEHOLDER_TOKEN_ID], 9),), 1)
    input_ids = build_model_inputs(out, BLOCK, torch.device("cpu")).input_ids
    with pytest.raises(ValueError, match="^sampled: no token for the placeholder of request 'd'$"):
        fill_placeholders(input_ids, out, sampled)


# ---- the engine: async against synchronous ---------------------------------------------------------


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _llm(directory: str, async_scheduling: bool | None, **kwargs) -> LLM:
    kwargs = {"block_size": BLOCK, **kwargs}
    return LLM(directory, async_scheduling=async_scheduling, **kwargs)


def _placeholder_counter(llm: LLM) -> dict[str, int]:
    """Counts, per request id, the slices scheduled with a placeholder (wraps the scheduler's schedule)."""
    counts: dict[str, int] = {}
    scheduler = llm.engine.core.scheduler
    schedule = scheduler.schedule

    def counting_schedule() -> SchedulerOutput:
        out = schedule()
        for s in out.scheduled:
            if PLACEHOLDER_TOKEN_ID in s.token_ids:
                counts[s.request_id] = counts.get(s.request_id, 0) + 1
        return out

    scheduler.schedule = counting_schedule
    return counts


def _both(directory, prompts, params, **kwargs):
    """(synchronous completions, async completions, async placeholder counts by request id)."""
    sync = _llm(directory, False, **kwargs)
    overlapped = _llm(directory, True, **kwargs)
    counts = _placeholder_counter(overlapped)
    expected, got = sync.generate(prompts, params), overlapped.generate(prompts, params)
    assert overlapped.engine.stats().num_kv_blocks_used == 0
    assert overlapped.engine.stats().num_generation_tokens == sync.engine.stats().num_generation_tokens
    return expected, got, counts


def _summary(completions) -> list[tuple]:
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in completions]


def _hf_greedy(directory: str, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """transformers' argmax, token by token (generate would stop at, or with min_new_tokens ban, the
    EOS ids that ignore_eos lets the engine produce)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(num_new):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("checkpoint", ["llama_dir", "qwen2_dir", "mistral_windowed_dir"])
def test_greedy_tokens_equal_transformers_with_chunks_and_decodes_overlapped(checkpoint, request):
    directory = request.getfixturevalue(checkpoint)
    prompts = _prompts(10, seed=1)
    # A 24-token budget splits most prompts into chunks that share steps with decodes.
    expected, got, counts = _both(directory, prompts, GREEDY, max_num_batched_tokens=24, max_num_seqs=8)
    assert [c.token_ids for c in got] == _hf_greedy(directory, prompts, GREEDY.max_tokens)
    assert _summary(got) == _summary(expected)
    # Every request decoded from placeholders: its first 11 tokens after the first were all in flight.
    assert sorted(counts) == sorted(c.request_id for c in got)
    assert all(n == GREEDY.max_tokens - 1 for n in counts.values()), counts


def test_eos_stop_tokens_and_lengths_finish_requests_whose_next_step_is_in_flight(llama_dir):
    prompts = _prompts(16, seed=11, hi=40)
    sync_free = _llm(llama_dir, False).generate(prompts, GREEDY)
    params = []
    for i, free in enumerate(sync_free):
        if i % 4 == 0:  # EOS made likely: the model emits it after a few tokens
            params.append(SamplingParams(temperature=0.0, max_tokens=16, logit_bias={EOS_ID: 2.0 + i % 3}))
        elif i % 4 == 1:  # a stop token the model produces mid-run
            params.append(SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[free.token_ids[4]]))
        else:  # max_tokens 1 .. 6
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i % 6, ignore_eos=True))
    expected, got, counts = _both(llama_dir, prompts, params, max_num_batched_tokens=32, max_num_seqs=16)
    assert _summary(got) == _summary(expected)
    reasons = {(c.finish_reason, c.stop_reason) for c in expected}
    assert {("stop", EOS_ID), ("length", None)} <= reasons
    assert any(c.finish_reason == "stop" and c.stop_reason not in (EOS_ID, None) for c in expected)
    assert len({len(c.token_ids) for c in expected}) >= 4 and counts


def test_stop_strings_cut_the_same_text(llama_dir):
    # Seeded sampling gives mostly ASCII text; the stop string is found by the frontend, which aborts the
    # request in the core while its next step is in flight.
    prompt = "the quick brown fox"
    params = dict(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    free = _llm(llama_dir, False).generate(prompt, SamplingParams(**params))[0]
    stop = next(free.text[i : i + 4] for i in range(3, len(free.text)) if free.text[i : i + 4].isalpha())
    expected, got, counts = _both(llama_dir, [prompt] * 3, SamplingParams(**params, stop=[stop]))
    assert _summary(got) == _summary(expected)
    assert got[0].finish_reason == "stop" and got[0].stop_reason == stop
    assert got[0].text == free.text[: free.text.index(stop)] and counts


def test_preemption_under_kv_pressure_keeps_greedy_and_seeded_outputs(llama_dir):
    prompts = _prompts(32, seed=7, lo=5, hi=120)
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True) for i in range(32)
    ]
    # Penalised ones among them: their counts follow each recompute, the token in flight included.
    params = [
        [seeded[i], GREEDY, dataclasses.replace(seeded[i], frequency_penalty=1.0), PENALISED][i % 4]
        for i in range(32)
    ]
    # 24 blocks of 16 tokens cannot hold 32 running requests: the newest ones get preempted.
    pressure = dict(num_blocks=24, max_num_batched_tokens=64, max_num_seqs=32)
    expected, got, counts = _both(llama_dir, prompts, params, **pressure)
    assert _summary(got) == _summary(expected)
    assert any(c.num_preemptions > 0 for c in got) and counts
    assert any(c.num_preemptions > 0 and counts.get(c.request_id) for c in got[3::4])


def test_prefix_hits_and_n_samples_compute_what_they_compute_synchronously(llama_dir):
    rng = random.Random(9)
    system = [rng.randrange(4, 512) for _ in range(3 * BLOCK)]
    prompts = [system + [rng.randrange(4, 512) for _ in range(n)] for n in (5, 21, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=3)
    runs = []
    for async_scheduling in (False, True):
        llm = _llm(llama_dir, async_scheduling)
        counts = _placeholder_counter(llm)
        completions = [c for p in prompts for c in llm.generate(p, params)]  # one after the other
        runs.append(
            (_summary(completions), [c.prompt_tokens_computed for c in completions], llm.engine.stats())
        )
    (expected, expected_computed, sync_stats), (got, got_computed, stats) = runs
    assert got == expected and got_computed == expected_computed
    assert (stats.prefix_cache_hits, stats.num_prompt_tokens_computed) == (
        sync_stats.prefix_cache_hits,
        sync_stats.num_prompt_tokens_computed,
    )
    assert stats.prefix_cache_hits > 0 and counts
    assert [c[0] for c in got[:3]] == [got[0][0]] * 3  # greedy samples agree


def test_logprobs_equal_the_synchronous_ones(llama_dir):
    prompts = _prompts(6, seed=13)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=6,
            ignore_eos=True,
            logprobs=i % 3 or None,
            prompt_logprobs=1 if i % 2 else None,
        )
        for i in range(6)
    ]
    expected, got, counts = _both(llama_dir, prompts, params, max_num_batched_tokens=32, max_num_seqs=8)
    assert [c.logprobs for c in got] == [c.logprobs for c in expected]
    assert [c.prompt_logprobs for c in got] == [c.prompt_logprobs for c in expected]
    assert got[1].logprobs is not None and len(got[1].logprobs) == 6 and counts
    assert len(got[1].prompt_logprobs) == len(prompts[1]) - 1


def test_a_request_whose_sampling_fails_ends_alone_and_its_step_in_flight_is_dropped(llama_dir, monkeypatch):
    monkeypatch.setenv("SLUICE_INJECT_FAULT", "sample:bad")
    llm = _llm(llama_dir, True, num_blocks=64)
    counts = _placeholder_counter(llm)
    engine = llm.engine
    good, bad = _prompts(2, seed=3)
    engine.add_request("good", good, GREEDY)
    engine.add_request("bad", bad, GREEDY)
    finals, received = {}, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "good":
                received.extend(output.token_ids)
            if output.finished:
                finals[output.request_id] = (output.finish_reason, output.usage.completion_tokens)
    assert finals == {"good": ("length", 12), "bad": ("error", 0)}
    assert received == _llm(llama_dir, False).generate(good, GREEDY)[0].token_ids
    # Its next step was launched (on a stand-in token) before the failure was seen, then dropped.
    assert counts == {"good": 11, "bad": 1}
    assert engine.stats().num_kv_blocks_used == 0


def test_a_constrained_request_left_no_token_ends_alone_and_its_next_row_goes_unmasked(
    llama_dir, monkeypatch, caplog
):
    """allowed_token_ids leave its choice no token: it ends with that error, after its next step was
    launched; that step's row must not feed the failed step's stand-in token to its grammar (which would
    refuse it, failing the whole batch's sampling)."""
    reference = _llm(llama_dir, False, attention_backend="torch")
    [red] = reference.generate(
        ["hello"], SamplingParams(temperature=0.0, constraint=Constraint(choice=("red",)))
    )
    outside = [t for t in range(1, 50) if t not in red.token_ids][:3]
    dead_end = SamplingParams(
        temperature=0.0, max_tokens=12, constraint=Constraint(choice=("red",)), allowed_token_ids=outside
    )
    llm = _llm(llama_dir, True, attention_backend="torch")
    counts = _placeholder_counter(llm)
    engine = llm.engine
    (mask,) = [p for p in engine.core.sampler.processors if isinstance(p, GrammarMask)]
    synced, sync = [], mask._sync_row
    monkeypatch.setattr(mask, "_sync_row", lambda row: synced.append(list(row.output_token_ids)) or sync(row))
    good, bad = _prompts(2, seed=3)
    engine.add_request("good", good, GREEDY)
    engine.add_request("bad", bad, dead_end)
    finals, received = {}, []
    with caplog.at_level(logging.WARNING):
        while engine.has_unfinished_requests():
            for output in engine.step():
                received += output.token_ids if output.request_id == "good" else []
                if output.finished:
                    finals[output.request_id] = (output.finish_reason, output.usage.completion_tokens)
    assert finals == {"good": ("length", 12), "bad": ("error", 0)}
    assert received == reference.generate(good, GREEDY)[0].token_ids
    assert counts["bad"] == 1 and synced and all(outputs == [] for outputs in synced)
    assert not caplog.records, caplog.text
    assert engine.stats().num_kv_blocks_used == 0


def test_a_step_that_raises_while_another_is_in_flight_leaves_the_llm_usable(llama_dir, monkeypatch):
    """A step raises (as an interrupt or a failing kernel would) while the one before it is in flight:
    `generate` raises, and the same LLM then gives the tokens it gave before. Both steps had been
    scheduled and were never updated; the next call's first update once found them and failed ("async
    updates must come in the order the steps were scheduled"), every call after too."""
    monkeypatch.setenv("SLUICE_INJECT_FAULT", "step:llm-2")
    llm = _llm(llama_dir, True, max_num_batched_tokens=BLOCK, max_num_seqs=4, num_blocks=64)
    counts = _placeholder_counter(llm)
    first = [5 + i for i in range(BLOCK)]  # the whole step budget: llm-2 waits for step 2
    expected = llm.generate(first, GREEDY)[0].token_ids  # llm-0
    with pytest.raises(InjectedFault, match="injected step fault for request 'llm-2'"):
        # Step 1 prefills llm-1 and stays in flight while step 2 (llm-1's decode and llm-2's first
        # chunk) raises at launch.
        llm.generate([first, list(range(40, 60))], GREEDY)
    assert counts["llm-1"] == 1  # step 2 was scheduled with llm-1's token in flight
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(first, GREEDY)[0].token_ids == expected  # llm-3
    assert llm.engine.stats().num_kv_blocks_used == 0


# ---- aborts in flight --------------------------------------------------------------------------------


def _drain(engine) -> dict[str, list[int]]:
    tokens_by_id: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens_by_id.setdefault(output.request_id, []).extend(output.token_ids)
    return tokens_by_id


@pytest.mark.parametrize(
    "params", [GREEDY, PENALISED, CONSTRAINED], ids=["plain", "penalised", "constrained"]
)
def test_an_abort_while_its_step_is_in_flight_frees_its_blocks_and_ends_its_tokens(llama_dir, params):
    prompts = _prompts(4, seed=17, lo=20, hi=40)
    expected = {f"r{i}": c.token_ids for i, c in enumerate(_llm(llama_dir, False).generate(prompts, params))}
    engine = _llm(llama_dir, True).engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    received: dict[str, list[int]] = {}
    scheduler = engine.core.scheduler
    while len(received.get("r2", [])) < 3:
        for output in engine.step():
            received.setdefault(output.request_id, []).extend(output.token_ids)
    victim = scheduler.get_request("r2")  # (a constrained one reaches the scheduler once compiled)
    assert scheduler.num_in_flight(victim) == 1  # its next token is being sampled
    blocks = len(scheduler.kv.block_ids("r2"))
    used = engine.stats().num_kv_blocks_used
    final = engine.abort(["r2"])
    assert [(o.request_id, o.finish_reason, o.token_ids) for o in final] == [("r2", "abort", ())]
    assert engine.stats().num_kv_blocks_used == used - blocks > 0
    for request_id, token_ids in _drain(engine).items():
        received.setdefault(request_id, []).extend(token_ids)
    assert received["r2"] == expected["r2"][:3]  # nothing after the abort
    assert {r: t for r, t in received.items() if r != "r2"} == {
        r: t for r, t in expected.items() if r != "r2"
    }
    assert engine.stats().num_kv_blocks_used == 0


@pytest.mark.parametrize(
    "params", [GREEDY, PENALISED, CONSTRAINED], ids=["plain", "penalised", "constrained"]
)
def test_an_id_aborted_and_reused_while_its_step_is_in_flight_starts_afresh(llama_dir, params):
    first, second = _prompts(2, seed=19, lo=10, hi=30)
    expected = _llm(llama_dir, False).generate(second, params)[0].token_ids
    engine = _llm(llama_dir, True).engine
    engine.add_request("x", first, params)
    while not any(output.token_ids for output in engine.step()):  # (a grammar compiles first)
        pass
    assert engine.core.scheduler.num_in_flight(engine.core.scheduler.get_request("x")) == 1
    engine.abort(["x"])
    engine.add_request("x", second, params)
    assert _drain(engine) == {"x": expected}


# ---- requests that make a step synchronous ---------------------------------------------------------


def test_needs_step_tokens_names_what_reads_the_tokens_on_the_host():
    def request(**params):
        r = make_request("r", [5, 6], max_tokens=8)
        r.sampling_params = SamplingParams(temperature=0.0, max_tokens=8, **params)
        return r

    assert not needs_step_tokens(request(), speculating=False)
    assert needs_step_tokens(request(), speculating=True)
    assert not needs_step_tokens(request(logit_bias={5: 1.0}, logprobs=2), speculating=False)
    # A grammar follows the token in flight on the host, penalties and min_tokens count it on the device
    # (the tests below).
    for params in (
        dict(repetition_penalty=1.2),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=0.5),
        dict(min_tokens=1),
        dict(constraint=Constraint(regex="[a-z]+")),
    ):
        assert not needs_step_tokens(request(**params), speculating=False), params
        assert counts_outputs(request(**params).sampling_params) != ("constraint" in params), params
    assert not counts_outputs(request(logit_bias={5: 1.0}, logprobs=2).sampling_params)
    opted_out = request()
    opted_out.use_speculation = False
    assert not needs_step_tokens(opted_out, speculating=True)


def test_speculation_runs_its_steps_synchronously_with_identical_greedy_tokens(llama_dir):
    rng = random.Random(4)
    phrase = [rng.randrange(4, 512) for _ in range(12)]
    prompts = [phrase * 3, [rng.randrange(4, 512) for _ in range(9)] * 4]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = _llm(llama_dir, False).generate(prompts, params)
    llm = _llm(llama_dir, True, speculative=SpeculativeConfig("ngram", num_speculative_tokens=3))
    counts = _placeholder_counter(llm)
    assert _summary(llm.generate(prompts, params)) == _summary(expected)
    assert llm.engine.stats().num_accepted_draft_tokens > 0
    assert counts == {}  # never scheduled before its tokens were known
    # Requests that opt out of speculation overlap as usual.
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"plain{i}", prompt, params, use_speculation=False)
    got = _drain(engine)
    assert [got[f"plain{i}"] for i in range(2)] == [c.token_ids for c in expected]
    assert set(counts) == {"plain0", "plain1"}


def test_a_verify_step_is_sampled_after_the_outputs_before_it_are_returned(llama_dir):
    """A step that verifies drafts is launched, then the step before's outputs are returned (a server's
    core sends them while the verify forward runs on a GPU), and only the next step samples it, before it
    schedules. Greedy and seeded requests give the synchronous engine's tokens."""
    rng = random.Random(9)
    phrase = [rng.randrange(4, 512) for _ in range(10)]
    prompts = [phrase * 4, [rng.randrange(4, 512) for _ in range(8)] * 4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
    ]
    speculative = SpeculativeConfig("ngram", num_speculative_tokens=3)
    expected = _llm(llama_dir, False, speculative=speculative).generate(prompts, params)
    llm = _llm(llama_dir, True, speculative=speculative)
    core = llm.engine.core
    events: list[str] = []
    launch, verify, schedule = core._launch, core.rejection_sampler.sample, core.scheduler.schedule

    def recording_launch(scheduler_output: SchedulerOutput):
        events.append(
            "launch verify" if any(s.spec_token_ids for s in scheduler_output.scheduled) else "launch"
        )
        return launch(scheduler_output)

    def recording_verify(logits, rows, proposals):
        events.append("sample verify" if any(p is not None for p in proposals) else "sample")
        return verify(logits, rows, proposals)

    def recording_schedule() -> SchedulerOutput:
        events.append("schedule")
        return schedule()

    core._launch = recording_launch
    core.rejection_sampler.sample = recording_verify
    core.scheduler.schedule = recording_schedule
    step = core.step

    def recording_step():
        outputs = step()
        events.append("return")
        return outputs

    core.step = recording_step
    assert _summary(llm.generate(prompts, params)) == _summary(expected)
    assert llm.engine.stats().num_accepted_draft_tokens > 0
    launches = [i for i, event in enumerate(events) if event == "launch verify"]
    assert len(launches) > 2
    for i in launches:
        # Returned before it is sampled; sampled in the next step before anything is scheduled.
        assert events[i + 1 : i + 4] == ["return", "sample verify", "schedule"], events[i - 3 : i + 6]


def _opting_out(llm: LLM, request_ids: set[str]) -> LLM:
    """`llm` with those requests opted out of speculation (`use_speculation=False`), as gRPC's
    `disable_speculation` does."""
    add_request = llm.engine.add_request

    def add(request_id: str, *args, **kwargs):
        return add_request(request_id, *args, use_speculation=request_id not in request_ids, **kwargs)

    llm.engine.add_request = add
    return llm


def test_constrained_and_penalised_requests_beside_speculating_ones_give_the_synchronous_outputs(llama_dir):
    """Opted out of speculation (constrained and penalised requests speculate otherwise), in an engine that
    speculates they overlap in the steps without a speculating request, and their grammars and counts follow
    the token in flight across the steps that do not."""
    rng = random.Random(6)
    phrase = [rng.randrange(4, 512) for _ in range(12)]
    prompts = [phrase * 3, _prompts(1, seed=7)[0], _prompts(1, seed=8)[0]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),  # speculates, then ends early
        SamplingParams(temperature=0.0, max_tokens=20, constraint=Constraint(regex="[a-z ]{10,30}")),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.8),
    ]
    speculative = SpeculativeConfig("ngram", num_speculative_tokens=3)
    opted_out = {"llm-1", "llm-2"}  # the ids LLM gives the second and third prompts
    expected = _opting_out(_llm(llama_dir, False, speculative=speculative), opted_out).generate(
        prompts, params
    )
    llm = _opting_out(_llm(llama_dir, True, speculative=speculative), opted_out)
    counts = _placeholder_counter(llm)
    got = llm.generate(prompts, params)
    assert {got[1].request_id, got[2].request_id} == opted_out
    assert _summary(got) == _summary(expected)
    assert set(counts) == opted_out
    assert llm.engine.stats().num_draft_tokens > 0  # drafts were verified beside them
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_a_verify_step_in_flight_finishes_before_the_next_even_when_its_speculating_request_was_aborted(
    llama_dir,
):
    # A verify step is sampled on the host: it has no device tokens for placeholders, so the request
    # beside the aborted one must not be scheduled with a placeholder for it.
    rng = random.Random(5)
    phrase = [rng.randrange(4, 512) for _ in range(12)]
    plain_prompt = [rng.randrange(4, 512) for _ in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = _llm(llama_dir, False).generate([plain_prompt], params)[0].token_ids
    llm = _llm(llama_dir, True, speculative=SpeculativeConfig("ngram", num_speculative_tokens=3))
    engine = llm.engine
    scheduler = engine.core.scheduler
    scheduled: list[SchedulerOutput] = []
    schedule = scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        scheduled.append(schedule())
        return scheduled[-1]

    scheduler.schedule = recording_schedule
    engine.add_request("spec", phrase * 3, params)
    engine.add_request("plain", plain_prompt, params, use_speculation=False)
    received: dict[str, list[int]] = {}
    for _ in range(60):  # until the step left in flight verifies drafts of "spec"
        for output in engine.step():
            received.setdefault(output.request_id, []).extend(output.token_ids)
        if any(s.request_id == "spec" and s.spec_token_ids for s in scheduled[-1].scheduled):
            break
    else:
        raise AssertionError("no verify step of 'spec' was left in flight")
    assert {s.request_id for s in scheduled[-1].scheduled} == {"spec", "plain"}
    engine.abort(["spec"])
    for request_id, token_ids in _drain(engine).items():
        received.setdefault(request_id, []).extend(token_ids)
    assert received["plain"] == expected
    assert engine.stats().num_kv_blocks_used == 0


def test_constrained_requests_overlap_and_their_grammars_follow_the_token_in_flight(llama_dir, caplog):
    """Each grammar accepts the token in flight on the host before the mask of the step launched after it;
    the step after a grammar's last token (eos) is launched before the core knows it ended, and its row
    goes unmasked (an xgrammar matcher refuses a mask once terminated: the batch would fall back to one row
    at a time, with an error logged). tests/test_structured_output.py runs its checks under async
    scheduling too."""
    prompts = _prompts(8, seed=23)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, constraint=Constraint(regex="[a-z]{3,8}")),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
        SamplingParams(
            temperature=0.0, max_tokens=12, repetition_penalty=1.5, constraint=Constraint(choice=("ab", "ba"))
        ),
        SamplingParams(temperature=0.7, seed=3, max_tokens=12, constraint=Constraint(regex="[0-9]{2,6}")),
    ] * 2
    sync = _llm(llama_dir, False, attention_backend="torch")
    overlapped = _llm(llama_dir, True, attention_backend="torch")
    counts = _placeholder_counter(overlapped)
    expected = sync.generate(prompts, params)
    with caplog.at_level(logging.WARNING):
        got = overlapped.generate(prompts, params)
    assert _summary(got) == _summary(expected)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert all(c.text.isalpha() and 3 <= len(c.text) <= 8 for c in got[::4]), [c.text for c in got[::4]]
    assert all(c.text in ("ab", "ba") for c in got[2::4]) and all(c.text.isdigit() for c in got[3::4])
    # Every step after a request's first decode had its token in flight, eos included (its next step's
    # result is dropped).
    assert all(counts.get(c.request_id, 0) >= len(c.token_ids) - 1 for c in got), counts
    assert overlapped.engine.stats().num_kv_blocks_used == 0


def _penalised_overlapped_and_synchronous(directory, prompts, params, **kwargs):
    expected, got, counts = _both(directory, prompts, params, attention_backend="torch", **kwargs)
    assert _summary(got) == _summary(expected)
    # Every step after a request's first decode had its token in flight: none ran synchronously (one
    # more, discarded, where a stop token ended the request while its next step was in flight).
    assert all(counts.get(c.request_id, 0) >= len(c.token_ids) - 1 for c in got), counts
    return got


def test_penalties_count_the_token_in_flight_and_give_the_synchronous_tokens(llama_dir):
    prompts = _prompts(6, seed=29, hi=30)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = _llm(llama_dir, False, attention_backend="torch").generate(prompts, greedy)
    params = [
        dataclasses.replace(greedy, repetition_penalty=2.0),
        dataclasses.replace(greedy, frequency_penalty=1.5),
        dataclasses.replace(greedy, presence_penalty=2.0),
        dataclasses.replace(greedy, temperature=0.8, seed=5, frequency_penalty=1.0, presence_penalty=0.5),
        dataclasses.replace(greedy, repetition_penalty=1.5, frequency_penalty=0.5),
        greedy,  # beside them, unpenalised
    ]
    got = _penalised_overlapped_and_synchronous(llama_dir, prompts, params)
    # The penalties change what greedy decoding picks, so a count missing the token in flight shows.
    assert sum(c.token_ids != p.token_ids for c, p in zip(got[:3], plain[:3], strict=True)) >= 2
    assert got[5].token_ids == plain[5].token_ids


def test_min_tokens_counts_the_token_in_flight_and_frees_the_stop_token_at_its_count(llama_dir):
    """Each request's stop token is the token greedy decoding picks first at position k (no earlier),
    with min_tokens k: it is held back before k and must end the request at k. A count that missed the
    token in flight would hold it back one step longer."""
    prompts = _prompts(6, seed=31, hi=30)
    free = _llm(llama_dir, False, attention_backend="torch").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    params = []
    for completion in free:
        tokens = completion.token_ids
        # (nor eos before it: min_tokens holds it back too, which would change the greedy path)
        k = next(k for k in range(4, 16) if tokens[k] not in tokens[:k] and EOS_ID not in tokens[:k])
        params.append(
            SamplingParams(temperature=0.0, max_tokens=16, min_tokens=k, stop_token_ids=[tokens[k]])
        )
    got = _penalised_overlapped_and_synchronous(llama_dir, prompts, params)
    for completion, free_completion, p in zip(got, free, params, strict=True):
        assert completion.token_ids == free_completion.token_ids[: p.min_tokens + 1]
        assert completion.stop_reason == p.stop_token_ids[0]


# ---- configuration and the server's core process -----------------------------------------------------


def test_the_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--async-scheduling"])
    assert engine_config_from_args(args).async_scheduling is True
    assert engine_config_from_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert engine_config_from_args(parser.parse_args([])).async_scheduling is None


def test_by_default_steps_overlap_on_one_cuda_device_only():
    """Unset, async scheduling is on where an H100 run measured it to pay (one CUDA device) and off on CPU
    and across tensor-parallel ranks (untimed there); given, it is what it says (with ranks too:
    tests/test_tensor_parallel_async.py)."""
    default = EngineConfig()
    assert default.schedules_async("cuda") and not default.schedules_async("cpu")
    assert not EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2)).schedules_async("cuda")
    assert EngineConfig(async_scheduling=True).schedules_async("cpu")
    assert not EngineConfig(async_scheduling=False).schedules_async("cuda")


def test_the_engine_core_on_cpu_schedules_synchronously_unless_asked(llama_dir):
    assert _llm(llama_dir, None).engine.core.async_scheduling is False
    assert _llm(llama_dir, True).engine.core.async_scheduling is True


def test_the_engine_core_process_overlaps_with_the_same_greedy_tokens(llama_dir):
    prompts = _prompts(4, seed=29)
    expected = [c.token_ids for c in _llm(llama_dir, False).generate(prompts, GREEDY)]
    config = EngineConfig(
        model=ModelConfig(model=llama_dir), cache=CacheConfig(block_size=BLOCK), async_scheduling=True
    )

    async def run() -> list[list[int]]:
        engine = AsyncEngine(config, engine_timeout=3600.0)
        await engine.start()
        try:
            streams = [await engine.add_request(f"p{i}", GREEDY, token_ids=p) for i, p in enumerate(prompts)]
            outputs = await asyncio.gather(*(_collect(s) for s in streams))
        finally:
            await engine.shutdown()
        return [[t for o in outs for t in o.token_ids] for outs in outputs]

    assert asyncio.run(run()) == expected


async def _collect(stream) -> list:
    return [output async for output in stream]


def test_a_grpc_server_with_async_scheduling_streams_the_offline_outputs_and_ends_aborts(llama_long_dir):
    # The real server and its core process (where placeholders cannot be counted: the in-process tests
    # above check that they are used), 8 concurrent requests beside one that runs until aborted.
    prompts = [f"{word} number {i}" for i, word in enumerate(["Hello", "The quick", "Café", "def add"] * 2)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    offline = LLM(llama_long_dir, num_blocks=128, attention_backend="torch")
    expected = [(c.text, c.token_ids) for c in offline.generate(prompts, params)]
    server = ServerThread(
        dataclasses.replace(long_engine_config(llama_long_dir), async_scheduling=True)
    ).start()
    try:
        with server.channel() as channel:
            stub = server.stub(channel)
            unending = stub.Generate(generate_request("Hello", request_id="forever", **UNENDING))
            first = next(unending)  # running: its next step is in flight from here on
            assert first.token_ids

            def generate(prompt: str) -> tuple[str, list[int]]:
                request = generate_request(prompt, temperature=0.0, max_tokens=10, ignore_eos=True)
                chunks = list(stub.Generate(request))
                assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
                return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]

            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(generate, prompts))
            assert got == expected
            assert stub.Abort(pb.AbortRequest(request_id="forever")) == pb.AbortResponse()
            assert list(unending)[-1].finish_reason == pb.FINISH_REASON_ABORT
        stats = server.wait_idle()
        assert stats.num_kv_blocks_used == 0
    finally:
        server.stop()
